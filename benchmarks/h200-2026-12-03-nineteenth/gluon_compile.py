import re, sys, subprocess, os, glob
sys.path.insert(0, '/work/main/.abwork')
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
import gluon_walk
k = gluon_walk.gluon_summary_kernel
names = k.arg_names
import json
extra = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
const = dict(**extra, s_gk=1, K=128, V=128, BT=64, BV=64, NCOL=256, MOFF=128, HAS_S=True, SPLIT_BF16=True, NSPLIT=2, VF=True, SCALAR_GATE=False, RAW_KEYS=False)
ptr = {'kg':'*bf16','w':'*bf16','u':'*bf16','gc':'*fp32','ws':'*fp32','work':'*i64'}
sig = {n: ('constexpr' if n in const else ptr.get(n, 'i32')) for n in names}
src = GluonASTSource(fn=k, signature=sig, constexprs={(names.index(n),): v for n, v in const.items()},
                     attrs={(names.index(n),): [["tt.divisibility", 16]] for n in names if n in ptr or (n.startswith('s_') and n != 's_gk')})
ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))
ptx = ck.asm['ptx']
print('wgmma', len(re.findall(r'wgmma.mma_async', ptx)), 'smem', ck.metadata.shared)
open('/tmp/g.ptx','w').write(ptx); open('/tmp/g.ttgir','w').write(ck.asm['ttgir'])
ptxas = glob.glob(os.path.join(os.path.dirname(triton.__file__), 'backends/nvidia/bin/ptxas'))[0]
r = subprocess.run([ptxas, '-v', '-arch=sm_90a', '/tmp/g.ptx', '-o', '/tmp/g.cubin'], capture_output=True, text=True)
print([l for l in (r.stdout + r.stderr).splitlines() if 'registers' in l or 'spill' in l or 'rror' in l])
seq=[]
for l in ptx.splitlines():
    s=l.strip()
    for key in ['wgmma.mma_async','wgmma.wait_group','wgmma.commit_group','wgmma.fence','bar.sync','cvt.rn.bf16x2','cvt.rn.bf16.f32','st.shared','ld.shared','cp.async.ca','cp.async.cg','cp.async.wait','cp.async.commit','fence.proxy', 'ex2', 'shfl', 'ld.global', 'mul.f32', 'sub.f32', 'add.f32', 'fma.rn.f32']:
        if s.startswith(key):
            seq.append(key if key!='wgmma.wait_group' else s); break
out=[];prev=None;n=0
for s in seq:
    if s==prev: n+=1
    else:
        if prev: out.append(f"{prev}x{n}")
        prev=s;n=1
out.append(f"{prev}x{n}")
print(" | ".join(out))
