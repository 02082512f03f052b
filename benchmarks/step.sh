# step NAME LIMIT_S COMMAND...: run COMMAND with a time limit, its output in $out/NAME.log, and print one status
# line; with ARCHIVE=FILE.tgz set, everything under $out so far is packed into that one file after each step.
# Sourced by benchmarks/one_gpu.sh and two_gpu.sh, which set $out.
step() {
    local name=$1 limit=$2
    shift 2
    : "${out:?step: set out to the output folder first (logs go to \$out/NAME.log)}"
    local start=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "$name: rc=$? in $((SECONDS - start)) s"
    if [ -n "${ARCHIVE:-}" ]; then tar czf "$ARCHIVE" -C "$out" .; fi
}
