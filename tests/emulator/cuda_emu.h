// CUDA device code on the CPU, for the tests: every thread of a launch is a fiber, and one OS
// thread switches between them at the points where CUDA threads meet or poll:
// __syncthreads, warp collectives, the cluster barrier, atomics, fences and acquire loads.
// The blocks of a cooperative or cluster launch are all resident at once, so the kernels'
// grid barriers and tickets work as on the GPU; other launches run in slots of 16K threads
// (or one block at a time). Shared memory is a per-block arena poisoned at launch;
// `__shared__` variables are placed in it by the build step (tests/emulator/__init__.py),
// which also turns the kernels' few inline-PTX statements into the calls below.
//
// What it checks: the kernels' index arithmetic, their barriers and collectives (a barrier
// or collective that can never complete is reported as a deadlock, a collective whose lanes
// disagree on its mask or kind as an error), and their results against the NumPy backend.
// What it does not: the GPU's weak memory model, timing, or bank conflicts. Each seed draws
// a schedule (warp speeds, held blocks, naps after barriers), so orders that depend on
// atomics differ between runs, as on a GPU.
#pragma once

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#define __CUDA_ARCH__ 900
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __cluster_dims__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __restrict__ __restrict

struct uint3 {
  unsigned x, y, z;
};
struct __attribute__((aligned(16))) int4 {
  int x, y, z, w;
};
struct __attribute__((aligned(16))) uint4 {
  unsigned x, y, z, w;
};
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

// CUDA's min and max take mixed integer types.
template <typename A, typename B>
inline auto min(A a, B b) -> decltype(a + b) {
  return a < b ? a : b;
}
template <typename A, typename B>
inline auto max(A a, B b) -> decltype(a + b) {
  return a < b ? b : a;
}

inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz((unsigned)v); }
inline unsigned __brev(unsigned v) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((v >> i) & 1u) << (31 - i);
  return r;
}
inline unsigned __umulhi(unsigned a, unsigned b) {
  return (unsigned)(((unsigned long long)a * b) >> 32);
}

namespace mla_emu {

// ---- switching between threads -------------------------------------------------------------
// x86-64: a switch saves the callee-saved registers on the old stack and pops them off the
// new one (glibc's swapcontext also saves the signal mask, a system call each way: several
// times slower). Elsewhere, ucontext.
#if defined(__x86_64__)
extern "C" void mla_emu_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.globl mla_emu_switch
.type mla_emu_switch, @function
mla_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size mla_emu_switch, .-mla_emu_switch
)");

struct Context {
  void* sp = nullptr;
};
// A new context that starts in `entry` on [stack, stack + size).
inline void make_context(Context& c, char* stack, size_t size, void (*entry)()) {
  auto top = reinterpret_cast<uintptr_t>(stack + size) & ~uintptr_t(15);
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;                           // entry's return address: it never returns
  *--sp = reinterpret_cast<void*>(entry);    // where the first switch's `ret` goes
  for (int i = 0; i < 6; ++i) *--sp = nullptr;  // rbp, rbx, r12 .. r15
  c.sp = sp;
}
inline void switch_context(Context& from, Context& to) { mla_emu_switch(&from.sp, to.sp); }
#else
struct Context {
  ucontext_t uc;
};
inline void make_context(Context& c, char* stack, size_t size, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

constexpr int STATIC_SMEM = 48 << 10;  // room for the kernels' __shared__ variables
constexpr size_t STACK_BYTES = 128 << 10;
constexpr unsigned char SMEM_POISON = 0xA5;
constexpr size_t SMEM_GUARD = 256;  // poisoned bytes past a block's dynamic shared memory

enum class Op { none, shfl, shfl_up, shfl_xor, ballot, reduce_or, reduce_add, match_any,
                syncwarp };

struct Collective {
  unsigned mask = 0, arrived = 0;
  bool done = false;
  int readers = 0;
  long gen = 0;
  Op op = Op::none;
  unsigned long long value[32];
  int arg[32];
  int width[32];  // shuffles: the lane groups' width (a power of two up to 32)
  unsigned long long result[32];
};

struct Warp {
  long syncs = 0;                   // full-warp collectives completed (racecheck)
  std::vector<Collective> by_mask;  // one in flight per mask
  Collective& get(unsigned mask) {
    for (auto& c : by_mask)
      if (c.mask == mask) return c;
    by_mask.emplace_back();
    by_mask.back().mask = mask;
    return by_mask.back();
  }
};

struct Block {
  unsigned index = 0;
  bool nap = false;  // passed a barrier and drew a nap: the scheduler holds it back
  std::vector<unsigned char> arena;  // [STATIC_SMEM | dynamic shared memory]
  int live = 0, arrived = 0;
  long gen = 0;
  std::vector<Warp> warps;
  unsigned exited_lanes[32] = {};  // per warp
#ifdef MLA_EMU_RACECHECK
  struct Word {  // the last write and reads of one byte of the arena
    // reader: the latest reading thread; others: the ones before it in the interval, as
    // -(3 + warp) when all were lanes of one warp, -2 when of two or more warps (-1: none).
    // *_syncs: the reading warp's full-warp collectives at the time of the read.
    int writer = -1, reader = -1, others = -1;
    long write_epoch = -1, read_epoch = -1, writer_syncs = 0, reader_syncs = 0,
         others_syncs = 0;
    bool atomic = false;
  };
  std::vector<Word> shadow;
#endif
  long cluster_phases = 0;  // cluster barriers completed (racecheck: they order like barriers)
};

struct Fiber {
  Context ctx;
  char* stack = nullptr;
  unsigned tid = 0;
  Block* block = nullptr;
  bool done = false;
  int yielded = 0;  // how its last yield came: RUN, POLL or BLOCKED
  long cluster_arrivals = 0;
  bool cluster_pending = false;  // arrived at the cluster barrier, not yet waited
  bool in_atomic = false;        // racecheck: its accesses now are an atomic's
  // What a BLOCKED thread waits for, so the scheduler resumes it only once it can go on.
  enum { BARRIER, RESULT, ROUND, CLUSTER } waits = BARRIER;
  long wait_gen = 0;      // BARRIER: the block's barrier generation; RESULT: the collective's
  unsigned wait_mask = 0; // RESULT, ROUND: the collective's mask
};

struct Cluster {
  long arrived = 0;
};

struct Launch {
  uint3 grid{1, 1, 1}, block{1, 1, 1};
  int cluster_blocks = 1;
  std::vector<Block> blocks;
  std::vector<Fiber> fibers;
  std::vector<Cluster> clusters;
  Context main;
  Fiber* cur = nullptr;
  std::mt19937_64 rng;
  unsigned preempt_per_mille = 0;  // chance of a switch at an atomic, fence or acquire load
  unsigned nap_per_mille = 0;      // chance of a block's nap after each of its barriers
  long events = 0;  // arrivals at barriers and collectives, atomics: what can unblock others
  long switches = 0, max_switches = 0;
  std::string error;
  void (*body)(const void* const*) = nullptr;
  const void* const* args = nullptr;
};

inline Launch*& current() {
  static Launch* l = nullptr;
  return l;
}
inline Fiber* me() { return current()->cur; }
inline bool& in_fiber() {  // a thread of the launch runs (not the scheduler)
  static bool on = false;
  return on;
}

enum { RUN, POLL, BLOCKED };  // why a thread yields: it may move on, polls, or waits

struct Abort {};  // unwinds a fiber after an error (the launch reports it)

[[noreturn]] inline void fail(const std::string& what) {
  Launch* l = current();
  if (l->error.empty()) {
    char where[96];
    std::snprintf(where, sizeof where, " (block %u, thread %u)", me()->block->index, me()->tid);
    l->error = what + where;
  }
  throw Abort{};
}

inline void yield(int why) {
  Launch* l = current();
  Fiber* f = l->cur;
  f->yielded = why;
  switch_context(f->ctx, l->main);
  if (!l->error.empty()) throw Abort{};
}

// A switch now and then where a GPU thread could be overtaken.
inline void maybe_preempt() {
  Launch* l = current();
  if (l->preempt_per_mille && (l->rng() % 1000) < l->preempt_per_mille) yield(RUN);
}

inline uint3 thread_idx() { return {me()->tid, 0, 0}; }
inline uint3 block_idx() { return {me()->block->index, 0, 0}; }
inline uint3 block_dim() { return current()->block; }
inline uint3 grid_dim() { return current()->grid; }

inline void syncthreads() {
  Block& b = *me()->block;
  const long gen = b.gen;
  ++current()->events;  // an arrival is progress: the barrier is nearer its release
  if (++b.arrived == b.live) {
    b.arrived = 0;
    ++b.gen;
    ++current()->events;
    // Now and then the block naps right after a barrier, held back until the others can go
    // no further: a block that others read from (a cluster's shared memory, a grid's
    // counts) may then be the one that is late, or the one that has left.
    Launch* l = current();
    if (l->nap_per_mille && (l->rng() % 1000) < l->nap_per_mille) b.nap = true;
    yield(RUN);
    return;
  }
  me()->waits = Fiber::BARRIER;
  me()->wait_gen = gen;
  while (b.gen == gen) yield(BLOCKED);
}

inline unsigned lane() { return me()->tid & 31; }

inline unsigned long long collective(Op op, unsigned mask, unsigned long long value, int arg,
                                     int width = 32) {
  Fiber* f = me();
  Block& b = *f->block;
  const unsigned ln = lane(), w = f->tid >> 5;
  if (!((mask >> ln) & 1u)) fail("a warp collective whose mask leaves out the calling lane");
  if (mask & b.exited_lanes[w]) fail("a warp collective whose mask names an exited lane");
  Collective* c = &b.warps[w].get(mask);
  f->wait_mask = mask;
  while (c->done) {  // the last round's results are still being read
    f->waits = Fiber::ROUND;
    yield(BLOCKED);
    c = &b.warps[w].get(mask);
  }
  if (c->arrived == 0) c->op = op;
  else if (c->op != op) fail("lanes of one mask in different warp collectives");
  if ((c->arrived >> ln) & 1u) fail("a lane in the same warp collective twice");
  if (width < 1 || width > 32 || (width & (width - 1)))
    fail("a shuffle width that is not a power of two up to 32");
  c->value[ln] = value;
  c->arg[ln] = arg;
  c->width[ln] = width;
  c->arrived |= 1u << ln;
  ++current()->events;
  const long gen = c->gen;
  if (c->arrived == mask) {
    for (unsigned i = 0; i < 32; ++i) {
      if (!((mask >> i) & 1u)) continue;
      unsigned long long r = 0;
      // Shuffles read within groups of `width` lanes (CUDA's rules): a source past the
      // group's end (shfl_up: before its start) gives the lane its own value; a source
      // lane outside the mask gives a poison value.
      const unsigned width = (unsigned)c->width[i], group = i & ~(width - 1);
      const auto from = [&](unsigned src) {
        return ((mask >> src) & 1u) ? c->value[src] : 0xDEADBEEFDEADBEEFull;
      };
      switch (op) {
        case Op::shfl:
          r = from(group + ((unsigned)c->arg[i] & (width - 1)));
          break;
        case Op::shfl_up: {
          const int src = (int)i - c->arg[i];
          r = src < (int)group ? c->value[i] : from((unsigned)src);
          break;
        }
        case Op::shfl_xor: {
          const unsigned src = i ^ (unsigned)c->arg[i];
          r = src >= group + width ? c->value[i] : from(src);
          break;
        }
        case Op::ballot:
          for (unsigned j = 0; j < 32; ++j)
            if (((mask >> j) & 1u) && c->value[j] != 0) r |= 1ull << j;
          break;
        case Op::reduce_or:
          for (unsigned j = 0; j < 32; ++j)
            if ((mask >> j) & 1u) r |= c->value[j];
          break;
        case Op::reduce_add:  // 32-bit wraparound, as the hardware's
          for (unsigned j = 0; j < 32; ++j)
            if ((mask >> j) & 1u) r = (unsigned)(r + c->value[j]);
          break;
        case Op::match_any:
          for (unsigned j = 0; j < 32; ++j)
            if (((mask >> j) & 1u) && c->value[j] == c->value[i]) r |= 1ull << j;
          break;
        case Op::syncwarp:
        case Op::none:
          break;
      }
      c->result[i] = r;
    }
    c->done = true;
    c->readers = __builtin_popcount(mask);
    ++current()->events;
    if (mask == 0xffffffffu) ++b.warps[w].syncs;
  } else {
    while (!(c->done && c->gen == gen)) {
      f->waits = Fiber::RESULT;
      f->wait_gen = gen;
      yield(BLOCKED);
      c = &b.warps[w].get(mask);
    }
  }
  const unsigned long long r = c->result[ln];
  if (--c->readers == 0) {
    c->done = false;
    c->arrived = 0;
    ++c->gen;
  }
  return r;
}

template <typename T>
inline unsigned long long bits_of(T v) {
  static_assert(sizeof(T) <= 8, "warp collectives of values up to 8 bytes");
  unsigned long long u = 0;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}
template <typename T>
inline T from_bits(unsigned long long u) {
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}

// ---- shared memory -------------------------------------------------------------------------
inline int static_offset(int id, size_t size, size_t align) {
  static std::vector<int> offsets, sizes;
  static int used = 0;
  if (id >= (int)offsets.size()) offsets.resize(id + 1, -1), sizes.resize(id + 1, 0);
  if (offsets[id] < 0) {
    used = (int)((used + align - 1) / align * align);
    offsets[id] = used;
    sizes[id] = (int)size;
    used += (int)size;
    if (used > STATIC_SMEM) throw std::runtime_error("emulator: static shared memory full");
  } else if (sizes[id] != (int)size) {  // one declaration, two sizes (a template's types)
    throw std::runtime_error("emulator: a __shared__ variable of two sizes");
  }
  return offsets[id];
}

template <typename T>
inline T& shared_var(int id) {
  unsigned char* arena = me()->block->arena.data();
  return *reinterpret_cast<T*>(arena + static_offset(id, sizeof(T), alignof(T)));
}

inline unsigned char* dynamic_smem() { return me()->block->arena.data() + STATIC_SMEM; }

// ---- PTX the kernels use -------------------------------------------------------------------
inline unsigned lanemask_lt() { return (1u << lane()) - 1u; }

inline unsigned load_acquire(const unsigned* p) {
  yield(POLL);  // a poll: let the others run
  return *reinterpret_cast<const volatile unsigned*>(p);
}

inline unsigned cluster_ctarank() { return me()->block->index % current()->cluster_blocks; }

inline Cluster& my_cluster() {
  return current()->clusters[me()->block->index / current()->cluster_blocks];
}

inline void cluster_arrive() {
  if (me()->cluster_pending) fail("two cluster barrier arrivals without a wait between them");
  me()->cluster_pending = true;
  Launch* l = current();
  ++me()->cluster_arrivals;
  ++l->events;
  if (++my_cluster().arrived % ((long)l->cluster_blocks * (long)l->block.x) != 0) return;
  // The phase is complete and no thread has left its wait yet. It orders the cluster's
  // shared-memory accesses as a barrier does (racecheck), and now and then one block of the
  // cluster naps, so the others may run on (and leave) before it reads their shared memory.
  Block* first = &l->blocks[me()->block->index / l->cluster_blocks * l->cluster_blocks];
  for (int k = 0; k < l->cluster_blocks; ++k) ++first[k].cluster_phases;
  if (l->nap_per_mille && (l->rng() % 1000) < 4 * l->nap_per_mille)
    first[l->rng() % l->cluster_blocks].nap = true;
}

inline void cluster_wait() {
  if (!me()->cluster_pending) fail("a cluster barrier wait without an arrival before it");
  me()->cluster_pending = false;
  Launch* l = current();
  const long need = me()->cluster_arrivals * (long)l->cluster_blocks * (long)l->block.x;
  me()->waits = Fiber::CLUSTER;
  me()->wait_gen = need;
  while (my_cluster().arrived < need) yield(BLOCKED);
}

inline unsigned long long mapa(const void* local, unsigned rank) {
  Launch* l = current();
  Block& b = *me()->block;
  const unsigned char* p = static_cast<const unsigned char*>(local);
  const unsigned char* base = b.arena.data();
  if (p < base || p >= base + b.arena.size()) fail("mapa of a pointer outside shared memory");
  if ((int)rank >= l->cluster_blocks) fail("mapa to a rank outside the cluster");
  Block& other = l->blocks[b.index / l->cluster_blocks * l->cluster_blocks + rank];
  return reinterpret_cast<unsigned long long>(other.arena.data() + (p - base));
}

inline unsigned long long globaltimer() { return (unsigned long long)current()->switches; }
inline unsigned smid() { return me()->block->index; }  // a block to an SM, as the probe sees it

// Whether a BLOCKED thread's wait is over (else resuming it would only yield again).
inline bool ready(Launch& l, const Fiber& f) {
  if (f.yielded != BLOCKED) return true;
  const Block& b = *f.block;
  switch (f.waits) {
    case Fiber::BARRIER:
      return b.gen != f.wait_gen;
    case Fiber::CLUSTER:
      return l.clusters[b.index / l.cluster_blocks].arrived >= f.wait_gen;
    default:
      for (const Collective& c : b.warps[f.tid >> 5].by_mask)
        if (c.mask == f.wait_mask)
          return f.waits == Fiber::ROUND ? !c.done : (c.done && c.gen == f.wait_gen);
      return true;
  }
}

// A thread that never reaches a switch point (a spin on a plain volatile load, say) cannot be
// taken off the CPU: a watchdog ends the process after WATCHDOG_S seconds without a switch,
// with a message, rather than leave a test run hanging.
constexpr int WATCHDOG_S = 120;
inline std::atomic<long>& switch_clock() {
  static std::atomic<long> n{0};
  return n;
}
inline std::atomic<bool>& in_launch() {
  static std::atomic<bool> on{false};
  return on;
}
inline void start_watchdog() {
  static std::once_flag once;
  std::call_once(once, [] {
    std::thread([] {
      long seen = -1;
      int still = 0;
      for (;;) {
        std::this_thread::sleep_for(std::chrono::seconds(1));
        const long now = switch_clock().load();
        still = (in_launch().load() && now == seen) ? still + 1 : 0;
        seen = now;
        if (still >= WATCHDOG_S) {
          std::fprintf(stderr, "emulator: a thread ran %d s without reaching a switch point "
                       "(a spin loop on a plain load?); ending the process\n", WATCHDOG_S);
          std::fflush(stderr);
          _exit(3);
        }
      }
    }).detach();
  });
}

// ---- the launch ------------------------------------------------------------------------------
inline void fiber_main() {
  Launch* l = current();
  Fiber* f = l->cur;
  try {
    if (l->error.empty()) l->body(l->args);
  } catch (const Abort&) {
  } catch (const std::exception& e) {
    if (l->error.empty()) l->error = e.what();
  }
  f->done = true;
  Block& b = *f->block;
  --b.live;
  b.exited_lanes[f->tid >> 5] |= 1u << (f->tid & 31);
  if (b.arrived > 0 && b.arrived == b.live) {  // the others may wait for no more
    b.arrived = 0;
    ++b.gen;
  }
  ++l->events;
  switch_context(f->ctx, l->main);
}

// Runs `body` over grid x block threads; returns "" or what went wrong. `all_resident`: every
// block at once (cooperative and cluster launches); else blocks of at most RESIDENT_THREADS
// threads in all at a time, each slot taking the next block once its block is done.
constexpr unsigned RESIDENT_THREADS = 16384;

inline std::string run(void (*body)(const void* const*), const void* const* args, unsigned grid,
                       unsigned block, size_t dynamic_smem_bytes, int cluster_blocks,
                       unsigned long long seed, unsigned preempt_per_mille, bool skew,
                       bool all_resident) {
  Launch l;
  l.grid = {grid, 1, 1};
  l.block = {block, 1, 1};
  l.cluster_blocks = cluster_blocks < 1 ? 1 : cluster_blocks;
  l.rng.seed(seed);
  l.preempt_per_mille = preempt_per_mille;
  l.nap_per_mille = skew ? 100 : 0;
  l.body = body;
  l.args = args;
  if (grid == 0 || block == 0) return "";
  if (grid % l.cluster_blocks) return "grid is not a whole number of clusters";
  // A launch that is not cooperative promises no residency: half the schedules run its
  // blocks one at a time, so a block that waits for another one deadlocks, as it may on a GPU.
  const unsigned slots =
      all_resident                 ? grid
      : (skew && (l.rng() & 1))    ? 1u
                                   : std::max(1u, std::min(grid, RESIDENT_THREADS / block));
  const size_t warps_per_block = (block + 31) / 32, nwarps = (size_t)slots * warps_per_block;
  l.blocks.resize(grid);
  l.clusters.resize(grid / l.cluster_blocks);
  l.fibers.resize((size_t)slots * block);
  // A loop that never ends but passes barriers (no deadlock to see): stopped here. Legit
  // kernels stay far below (the ordered prefix over 2211 buckets in one block: 3000 a thread).
  l.max_switches = 50000L * (long)grid * (long)block + 10000000L;
  // Stacks: reserved, not committed (a page is backed once a fiber touches it).
  const size_t stack_bytes = (size_t)slots * block * STACK_BYTES;
  void* stack_map = mmap(nullptr, stack_bytes, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (stack_map == MAP_FAILED) return "emulator: no memory for the threads' stacks";
  std::unique_ptr<void, std::function<void(void*)>> stacks(
      stack_map, [stack_bytes](void* m) { munmap(m, stack_bytes); });
  // Skew: every warp gets a speed (its block's x its own, at least 1/16), the chance that it
  // runs in a pass, and each lane skips a pass now and then, so warps and blocks drift apart
  // as far as their barriers let them and a missing barrier shows as a read before the write
  // it should have waited for. Held blocks (about half) start only once the others can go no
  // further, one at a time: as late as a GPU could start them, so a block's stores (a fill
  // block's, say) land after those of any block that should have waited for them and did not.
  std::vector<double> speed(nwarps, 1.0);
  std::vector<char> held(slots, 0);
  std::vector<long> slot_block(slots, -1);
  size_t holding = 0;
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  unsigned next_block = 0;
  const auto start_block = [&](unsigned s) {
    const unsigned bi = next_block++;
    slot_block[s] = bi;
    Block& b = l.blocks[bi];
    b.index = bi;
    b.arena.assign(STATIC_SMEM + dynamic_smem_bytes + SMEM_GUARD, SMEM_POISON);
    b.live = (int)block;
    b.arrived = 0;
    b.gen = 0;
    b.warps.assign(warps_per_block, Warp());
#ifdef MLA_EMU_RACECHECK
    b.shadow.assign(b.arena.size(), Block::Word());
#endif
    std::fill(std::begin(b.exited_lanes), std::end(b.exited_lanes), 0u);
    for (unsigned t = 0; t < block; ++t) {
      Fiber& f = l.fibers[(size_t)s * block + t];
      f = Fiber();
      f.block = &b;
      f.tid = t;
      f.stack = static_cast<char*>(stack_map) + ((size_t)s * block + t) * STACK_BYTES;
      make_context(f.ctx, f.stack, STACK_BYTES, fiber_main);
    }
    if (skew) {
      const double block_speed = 0.25 + 0.75 * coin(l.rng);
      for (size_t w = 0; w < warps_per_block; ++w)
        speed[s * warps_per_block + w] = block_speed * (0.25 + 0.75 * coin(l.rng));
      held[s] = (char)(l.rng() & 1);
      holding += held[s];
    }
  };
  current() = &l;
  start_watchdog();
  in_launch() = true;
  for (unsigned s = 0; s < slots; ++s) start_block(s);
  std::vector<size_t> order(nwarps);
  for (size_t w = 0; w < nwarps; ++w) order[w] = w;
  size_t left = (size_t)grid * block;
  int idle_passes = 0;  // passes in which nothing could have changed what anyone waits for
  while (left > 0 && l.error.empty()) {
    std::shuffle(order.begin(), order.end(), l.rng);
    const long events = l.events;
    const bool everyone = !skew || idle_passes > 0;  // after an idle pass, a full one
    bool moved = false;
    for (size_t w : order) {
      const size_t s = w / warps_per_block;
      if (slot_block[s] < 0) continue;
      Block& napper = l.blocks[slot_block[s]];
      if (napper.nap) {  // held until an idle pass starts it again
        napper.nap = false;
        if (!held[s]) held[s] = 1, ++holding;
      }
      if (held[s]) continue;
      if (!everyone && coin(l.rng) >= speed[w]) continue;
      const size_t first = s * block + (w % warps_per_block) * 32;
      const size_t lanes = std::min<size_t>(32, (s + 1) * block - first);
      const size_t rot = l.rng() % lanes;
      for (size_t k = 0; k < lanes && l.error.empty(); ++k) {
        Fiber& f = l.fibers[first + (k + rot) % lanes];
        if (f.done || !ready(l, f) || (!everyone && (l.rng() & 3) == 0)) continue;
        l.cur = &f;
        ++l.switches;
        switch_clock().fetch_add(1, std::memory_order_relaxed);
        in_fiber() = true;
        switch_context(l.main, f.ctx);
        in_fiber() = false;
        if (f.done) --left, moved = true;
        else if (f.yielded == RUN) moved = true;
      }
      if (!l.error.empty()) break;
      Block& b = l.blocks[slot_block[s]];
      if (b.live == 0) {  // the slot's block is done: its shared memory goes, the next starts
        for (size_t k = b.arena.size() - SMEM_GUARD; k < b.arena.size(); ++k)
          if (b.arena[k] != SMEM_POISON && l.error.empty()) {
            char what[96];
            std::snprintf(what, sizeof what, "block %u wrote past its %zu bytes of dynamic "
                          "shared memory", b.index, dynamic_smem_bytes);
            l.error = what;
          }
        // In a cluster another block may still read it (mapa): poisoned, not freed, so such
        // a read (a block that left before the others were done with it) gives garbage.
        if (all_resident) std::fill(b.arena.begin(), b.arena.end(), SMEM_POISON);
        else std::vector<unsigned char>().swap(b.arena);
        slot_block[s] = -1;
        if (next_block < grid) start_block((unsigned)s);
        moved = true;
      }
    }
    idle_passes = (moved || events != l.events) ? 0 : idle_passes + 1;
    if (idle_passes >= 2 && holding > 0) {  // the others are stuck or done: start a held one
      size_t pick = l.rng() % holding;
      for (unsigned s = 0; s < slots; ++s)
        if (held[s] && pick-- == 0) held[s] = 0;
      --holding;
      idle_passes = 0;
    }
    if (l.error.empty() && left > 0 && idle_passes >= 3)
      l.error = "deadlock: every thread waits at a barrier, a collective or a poll that "
                "nothing left can satisfy";
    if (l.error.empty() && l.switches > l.max_switches)
      l.error = "no progress: threads polled past the switch limit";
  }
  if (!l.error.empty()) {
    // Unwind every fiber still inside the body (each throws Abort at its yield).
    for (Fiber& f : l.fibers) {
      if (f.done || f.block == nullptr) continue;
      l.cur = &f;
      switch_context(l.main, f.ctx);
    }
  }
  if (std::getenv("MLA_EMU_STATS"))
    std::fprintf(stderr, "switches %ld grid %u block %u\n", l.switches, grid, block);
  in_launch() = false;
  current() = nullptr;
  return l.error;
}

}  // namespace mla_emu

#define threadIdx (mla_emu::thread_idx())
#define blockIdx (mla_emu::block_idx())
#define blockDim (mla_emu::block_dim())
#define gridDim (mla_emu::grid_dim())
#define dynamic_smem (mla_emu::dynamic_smem())

inline void __syncthreads() { mla_emu::syncthreads(); }
inline void __threadfence() { mla_emu::maybe_preempt(); }
inline void __threadfence_block() {}
inline long long clock64() { return (long long)mla_emu::current()->switches; }
inline void __nanosleep(unsigned) { mla_emu::yield(mla_emu::POLL); }

template <typename T>
inline T __ldcg(const T* p) {
  mla_emu::maybe_preempt();
  return *p;
}
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}

template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  return mla_emu::from_bits<T>(
      mla_emu::collective(mla_emu::Op::shfl, mask, mla_emu::bits_of(v), src, width));
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return mla_emu::from_bits<T>(
      mla_emu::collective(mla_emu::Op::shfl_up, mask, mla_emu::bits_of(v), (int)delta, width));
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return mla_emu::from_bits<T>(
      mla_emu::collective(mla_emu::Op::shfl_xor, mask, mla_emu::bits_of(v), lane_mask, width));
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return (unsigned)mla_emu::collective(mla_emu::Op::ballot, mask, pred != 0, 0);
}
inline unsigned __reduce_or_sync(unsigned mask, unsigned v) {
  return (unsigned)mla_emu::collective(mla_emu::Op::reduce_or, mask, v, 0);
}
inline int __reduce_add_sync(unsigned mask, int v) {
  return (int)(unsigned)mla_emu::collective(mla_emu::Op::reduce_add, mask, (unsigned)v, 0);
}
template <typename T>
inline unsigned __match_any_sync(unsigned mask, T v) {
  return (unsigned)mla_emu::collective(mla_emu::Op::match_any, mask, mla_emu::bits_of(v), 0);
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  mla_emu::collective(mla_emu::Op::syncwarp, mask, 0, 0);
}

namespace mla_emu {
// Atomics: no other thread runs between the read and the write (one OS thread), so a
// read-modify-write is atomic; a switch may come first, where a GPU thread could be overtaken.
template <typename T, typename Update>
inline T atomic_update(T* p, Update update) {
  maybe_preempt();
  me()->in_atomic = true;
  const T old = *p;
  *p = update(old);
  me()->in_atomic = false;
  ++current()->events;
  return old;
}
}  // namespace mla_emu

template <typename T>
inline T atomicAdd(T* p, T v) {
  return mla_emu::atomic_update(p, [v](T old) { return old + v; });
}
template <typename T>
inline T atomicOr(T* p, T v) {
  return mla_emu::atomic_update(p, [v](T old) { return old | v; });
}
template <typename T>
inline T atomicMax(T* p, T v) {
  return mla_emu::atomic_update(p, [v](T old) { return old < v ? v : old; });
}
template <typename T>
inline T atomicExch(T* p, T v) {
  return mla_emu::atomic_update(p, [v](T) { return v; });
}

#ifdef MLA_EMU_RACECHECK
// Racecheck: built with -fsanitize=thread, the compiler calls these hooks before every load
// and store; no sanitizer runtime is linked. Accesses to the running thread's own block's
// shared memory are checked against the word's last write and reads: two threads touching
// a word in one barrier interval, one of them writing (not both atomically), is a hazard
// unless both are lanes of one warp with a full-warp collective between them.
namespace mla_emu {
__attribute__((no_sanitize_thread)) inline void shared_access(const void* addr, size_t size,
                                                              bool write) {
  static bool busy = false;  // the checks' own loads and stores are instrumented too
  if (busy || !in_fiber()) return;
  busy = true;
  Launch* l = current();
  Fiber* f = l->cur;
  Block& b = *f->block;
  const unsigned char* base = b.arena.data();
  const unsigned char* p = static_cast<const unsigned char*>(addr);
  if (p >= base && p < base + b.arena.size() && !b.shadow.empty()) {
    const int me_tid = (int)f->tid;
    const long epoch = b.gen + (b.cluster_phases << 32), syncs = b.warps[f->tid >> 5].syncs;
    const int my_warp = me_tid >> 5;
    const auto warp_of = [](int who) { return who >= 0 ? who >> 5 : who <= -3 ? -3 - who : -1; };
    const auto synced = [&](int other, long other_syncs) {
      return warp_of(other) == my_warp && syncs > other_syncs;
    };
    const char* hazard = nullptr;
    int other = -1;
    for (size_t k = (size_t)(p - base); k < (size_t)(p - base) + size && k < b.shadow.size(); ++k) {
      Block::Word& w = b.shadow[k];
      if (w.writer >= 0 && w.writer != me_tid && w.write_epoch == epoch &&
          !(f->in_atomic && w.atomic) && !synced(w.writer, w.writer_syncs)) {
        hazard = write ? "write after write" : "read after write";
        other = w.writer;
      } else if (write && w.read_epoch == epoch && !f->in_atomic &&
                 ((w.reader >= 0 && w.reader != me_tid && !synced(w.reader, w.reader_syncs)) ||
                  (w.others != -1 && !synced(w.others, w.others_syncs)))) {
        hazard = "write after read";
        other = w.reader != me_tid ? w.reader : w.others;
      }
      if (hazard) {
        char what[200];
        std::snprintf(what, sizeof what,
                      "racecheck: %s hazard on shared byte %zu of block %u: thread %u after "
                      "thread %d, no barrier between", hazard, k,
                      b.index, f->tid, other);
        // Recorded, not thrown: a hook's call site has no unwind information. The thread's
        // next switch point ends the launch with it.
        if (l->error.empty()) l->error = what;
        busy = false;
        return;
      }
      if (write) {
        w.writer = me_tid, w.write_epoch = epoch, w.writer_syncs = syncs;
        w.atomic = f->in_atomic;
      } else if (w.read_epoch != epoch || w.reader == -1) {
        w.reader = me_tid, w.read_epoch = epoch, w.reader_syncs = syncs, w.others = -1;
      } else {
        if (w.reader != me_tid) {  // the previous reader joins the others
          const int rw = warp_of(w.reader);
          w.others = (w.others == -1 || warp_of(w.others) == rw) ? -3 - rw : -2;
          w.others_syncs = w.reader_syncs;
          w.reader = me_tid;
        }
        w.reader_syncs = syncs;
      }
    }
  }
  busy = false;
}
}  // namespace mla_emu

#define MLA_HOOK(name, n, write)                                                  \
  extern "C" __attribute__((no_sanitize_thread)) void name(void* p) {             \
    mla_emu::shared_access(p, n, write);                                          \
  }
#define MLA_HOOKS(n)                                                              \
  MLA_HOOK(__tsan_read##n, n, false) MLA_HOOK(__tsan_unaligned_read##n, n, false) \
  MLA_HOOK(__tsan_write##n, n, true) MLA_HOOK(__tsan_unaligned_write##n, n, true)
MLA_HOOKS(1) MLA_HOOKS(2) MLA_HOOKS(4) MLA_HOOKS(8) MLA_HOOKS(16)
extern "C" __attribute__((no_sanitize_thread)) void __tsan_read_range(void* p, unsigned long n) {
  if (n) mla_emu::shared_access(p, n, false);
}
extern "C" __attribute__((no_sanitize_thread)) void __tsan_write_range(void* p, unsigned long n) {
  if (n) mla_emu::shared_access(p, n, true);
}
extern "C" __attribute__((no_sanitize_thread)) void __tsan_func_entry(void*) {}
extern "C" __attribute__((no_sanitize_thread)) void __tsan_func_exit() {}
extern "C" __attribute__((no_sanitize_thread)) void __tsan_init() {}
extern "C" __attribute__((no_sanitize_thread)) void __tsan_vptr_update(void**, void*) {}
// The watchdog's atomics (memory orders passed as ints, as the sanitizer's ABI has them).
extern "C" __attribute__((no_sanitize_thread)) long __tsan_atomic64_fetch_add(volatile long* a,
                                                                             long v, int) {
  return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);
}
extern "C" __attribute__((no_sanitize_thread)) long __tsan_atomic64_load(const volatile long* a,
                                                                        int) {
  return __atomic_load_n(a, __ATOMIC_SEQ_CST);
}
extern "C" __attribute__((no_sanitize_thread)) char __tsan_atomic8_load(const volatile char* a,
                                                                       int) {
  return __atomic_load_n(a, __ATOMIC_SEQ_CST);
}
extern "C" __attribute__((no_sanitize_thread)) void __tsan_atomic8_store(volatile char* a,
                                                                        char v, int) {
  __atomic_store_n(a, v, __ATOMIC_SEQ_CST);
}
#endif
