"""Every memo kdacp keeps across calls, in one place, with its bound.

Each memo is built from host-side facts (shapes, boundaries, configurations) and saves host work or a
device sync on later calls; none holds a tensor a caller passed.

| memo | kept in | entries | bound |
|---|---|---|---|
| sub-segment work lists of the summary kernels | ``kernels.planning`` | ``(bounds, chunk size, device)`` | :data:`SUMMARY_PLANS` (LRU) |
| pipeline stages that fit in shared memory | ``kernels.stages`` | ``(kernel, constants, dtypes, warps)`` | the kernels and configurations a process launches |
| FLA's packed-sequence arguments | ``backends.fla_backend`` | boundaries of a batch | :data:`FLA_VARLEN_BATCHES` (LRU) |
| FLA's modules, and whether its GDN backward runs here | ``backends.fla_adapter`` | one | one |
| scan schedules | ``distributed.strategies`` | ``(emits, affine)`` of a route | :data:`SCAN_SCHEDULES` (LRU) |
| rank layouts of a batch | ``distributed.plan`` | ``(boundaries, batch size, rank lengths)`` | :data:`RANK_LAYOUTS` (LRU) |
| a plan's forward and backward routes | ``distributed.orchestration`` | ``(plan, tokens per row, state shape, dtype, device)`` | :data:`ROUTES` (LRU) |
| GDN's ``dt_bias`` stand-in for the KDA op's checks (a meta tensor) | ``gdn`` | ``(size, dtype)`` | :data:`META_STAND_INS` (LRU) |
| call signatures every rank verified | ``distributed.checks`` | per live plan (:func:`~kdacp.distributed.checks.verified_plans`) | freed with its plan |
| a layer context's packed batches (host copy, plan, convolution context) | ``layers.context_parallel`` | per context | :data:`CACHED_BATCHES` (oldest dropped) |
| the opaque regions a compiled graph names by id (their settings: a layer context, the op, head dims) | ``compile`` | per distinct settings | one per layer kind and context, for the process (:func:`~kdacp.compile.region_count`) |
| a layer context's plans of batch rows | ``layers.context_parallel`` | per context | :data:`CACHED_SHAPES` (least recent dropped) |
"""

SUMMARY_PLANS = 64        # summary kernels' sub-segment plans (a few per batch, forward and backward)
FLA_VARLEN_BATCHES = 16   # batches whose FLA cu_seqlens / chunk_indices are kept (a few in flight, per chunk size)
SCAN_SCHEDULES = 512      # routes whose scan schedule is kept
CACHED_BATCHES = 8        # packed batches whose host copy and plan a layer context keeps (a few are in flight)
CACHED_SHAPES = 64        # shapes of batch rows whose plan a layer context keeps
RANK_LAYOUTS = 64         # batches whose rank layouts are kept (every layer of a step asks for the same)
ROUTES = 64               # (plan, shape) pairs whose routes are kept
META_STAND_INS = 16       # sizes and dtypes of GDN's dt_bias stand-in
