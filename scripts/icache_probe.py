"""Does straight-line code cost instruction-fetch latency? Graph µs of one block running the
same arithmetic unrolled (a long code path) and as a loop (a short one)."""
import cupy
import numpy as np

from moe_lora_align.bench import graph_us

SRC = r"""
// Four independent chains of shared-memory loads whose addresses depend on the data, so
// nothing folds; unrolled, the code is about 16 bytes x 3 x 4 x N long.
template <int N, bool UNROLL>
__global__ void work(const int* in, int* out) {
  __shared__ int s[1024];
  for (int k = threadIdx.x; k < 1024; k += blockDim.x) s[k] = in[k] & 1023;
  __syncthreads();
  int a = threadIdx.x, b = a ^ 1, c = a ^ 2, d = a ^ 3;
  if (UNROLL) {
#pragma unroll
    for (int k = 0; k < N; ++k) { a = s[(a + k) & 1023]; b = s[(b ^ k) & 1023];
                                  c = s[(c + 3 * k) & 1023]; d = s[(d ^ (5 * k)) & 1023]; }
  } else {
#pragma unroll 1
    for (int k = 0; k < N; ++k) { a = s[(a + k) & 1023]; b = s[(b ^ k) & 1023];
                                  c = s[(c + 3 * k) & 1023]; d = s[(d ^ (5 * k)) & 1023]; }
  }
  out[threadIdx.x] = a + b + c + d;
}
"""
names = [f"work<{n}, {u}>" for n in (16, 64, 256, 1024) for u in ("true", "false")]
mod = cupy.RawModule(code=SRC, name_expressions=names, options=("-std=c++17",))
src = cupy.arange(1024, dtype=np.int32)
dst = cupy.empty_like(src)
stream = cupy.cuda.Stream(non_blocking=True)
for threads in (128,):
    for n in names:
        k = mod.get_function(n)
        t = graph_us(lambda: k((1,), (threads,), (src, dst)), stream)
        print(f"  {threads:5d} threads {n:22s} {t:6.2f} us (4 x {n.split('<')[1].split(',')[0]} dependent LDS)")
