import re, sys, subprocess, os, glob
sys.path.insert(0, '/work/main/.abwork')
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon import language as gl
import gluon_walk
k = gluon_walk.gluon_summary_tma_kernel
names = k.arg_names
print(names)
const = dict(s_gk=1, K=128, V=128, BT=64, BV=64, NCOL=256, MOFF=128)
wl = gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
ul = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
sig = {}
for n in names:
    if n in const: sig[n] = 'constexpr'
    elif n in ('kg_desc', 'w_desc'): sig[n] = f'tensordesc<bf16[64, 128],{wl!r}>'
    elif n == 'u_desc': sig[n] = f'tensordesc<bf16[64, 64],{ul!r}>'
    elif n == 'gc': sig[n] = '*fp32'
    elif n == 'ws': sig[n] = '*fp32'
    elif n == 'work': sig[n] = '*i64'
    else: sig[n] = 'i32'
print(sig['w_desc'])
src = GluonASTSource(fn=k, signature=sig, constexprs={(names.index(n),): v for n, v in const.items()})
ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
ptx = ck.asm['ptx']
print('wgmma', len(re.findall(r'wgmma.mma_async', ptx)), 'smem', ck.metadata.shared)
open('/tmp/gt.ptx','w').write(ptx)
ptxas = glob.glob(os.path.join(os.path.dirname(triton.__file__), 'backends/nvidia/bin/ptxas'))[0]
r = subprocess.run([ptxas, '-v', '-arch=sm_90a', '/tmp/gt.ptx', '-o', '/tmp/gt.cubin'], capture_output=True, text=True)
print([l for l in (r.stdout + r.stderr).splitlines() if ('registers' in l or 'spill' in l or 'rror' in l)])
