"""The prepared path's own Python cost, without a GPU: a public call with out= on fake CuPy
arrays, its launches stubbed (what is left is the key, the lookup, the pointer rewrite and the
answer; a real call adds CuPy's attribute reads and the driver launch).

    PYTHONPATH=. python scripts/call_overhead.py [prof]
"""
import sys, timeit, types, cProfile, pstats
import os
sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'tests'))
import numpy as np
from test_call_path import FakeCupy, _job, _call_of
from moe_lora_align import _call, _launch
import moe_lora_align as mla
_call._KINDS.clear(); _call._KINDS[FakeCupy]="cupy"
_call._fast.update(get_device=lambda:0, current_stream=lambda: types.SimpleNamespace(ptr=7), is_capturing=lambda p:0)
call=_call_of(_job(0x1000))
call.job.packed=np.zeros(_launch.PROBLEM_DTYPE.itemsize,np.uint8)
rec=[_launch.RecordedLaunch(1,1,32,0,7,0,())]
_launch.replay_launches=lambda l,s: None
if hasattr(_call, "replay_launches"): _call.replay_launches=lambda l,s: None
ids=FakeCupy(0x1000,(8,1)); out=(FakeCupy(0x2000,(20,)),FakeCupy(0x3000,(5,)),FakeCupy(0x4000,(1,)))
opts=("base",4,4,None,False,False,False,False,None,None,None)
key,ptrs,dev,sp,given=_call._fast_key(opts,(ids,None,None,None,None),(out,None),None)
prep=_call.build_prepared([call],(rec,None,[],None),ptrs,"cupy",sp)
_call._caches.setdefault(0,{})[key]=prep
f=lambda: mla.moe_align_block_size(ids,4,4,out=out)
f()
n=50000
t=timeit.timeit(f,number=n)/n*1e6
print(f"fast path with fake arrays: {t:.2f} us")
if len(sys.argv)>1:
    pr=cProfile.Profile(); pr.enable()
    for _ in range(n): f()
    pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(12)
