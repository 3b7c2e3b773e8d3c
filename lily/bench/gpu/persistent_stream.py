"""The persistent decode step's protocol on the real byte volume, without the model's maths:
a CUDA C++ kernel (lily/ops/cuda_rtc.py) of one block per SM that streams every phase's
bytes (lily/ops/step_plan.py) through a shared-memory ring fed by bulk copies, with a
dependency counter in global memory between phases.

Each block: one producer warp issues the block's chunks in order into a ring of ``stages``
slots (``cp.async.bulk`` completing on an mbarrier), running ahead across phase
boundaries (mode 1) or only once the phase's input is complete (mode 2); routed chunks
(the MoE's experts) are requested only after the router phase's counter is complete and
the "routing" is read from its output. Consumer warps wait for a phase's input counter,
read the 4 KB input activation, consume the phase's chunks (a checksum; with ``mma``
also the dequantizing tensor-core arithmetic of the 4-bit GEMVs, one mma.sync per 32
codes, in one of the loops of MMA_LOOPS), write the block's result and count themselves in.
Mode 0 streams with no waits.

Checked exactly: block b's result in phase p is the sum of its bytes (as uint32) plus the
sum of the input activation, so a phase's activation sum is
``A[p] = S[p] + blocks * A[after[p]]`` (mod 2^32; the step's input is its epoch), and the
routed slots take experts ``(A[router] + 37 j) mod E``: a read before all blocks wrote, or a
wrong expert, changes the final value ``expected_final`` computes on the host.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from lily.ops import cuda_rtc
from lily.ops.step_plan import Phase, split_chunks

ACT = 1024  # uint32 words of a phase's activation (4 KB, as the model's bf16 x)
RESULTS = 64  # final values kept, by epoch
MMA_LOOPS = {  # the consumer's arithmetic, by the kernel's MMA option
    0: "checksum only",
    1: "the first loop: 4 MMAs a uint4 into one accumulator, scaled at once, bounds tested",
    2: "tighter: constants in registers, full chunks without a bounds test, scale a group late",
    3: "as 2, the unpacking's shifts on the FMA pipe (IMAD.HI) instead of the ALU",
}

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;
#define CPAD 32  // a counter every 128 bytes: polls of one phase and arrivals at the next
                 // do not share a line

__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 a; asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }"
                      : "=r"(a) : "l"(p)); return a; }
__device__ __forceinline__ u64 now() {
  u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ u32 ld_acquire(const u32* p) {
  u32 v; asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v; }
__device__ __forceinline__ uint4 ld_cg4(const uint4* p) {
  uint4 v; asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
                        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p)); return v; }
// Spins until the counter reaches target. A wait that lasts 0.5 s sets *abort, and every
// wait returns at once after that: a broken protocol fails the host's check in about a
// second instead of hanging the GPU for minutes.
__device__ __forceinline__ void wait_count(const u32* c, u32 target, u32* abort) {
  u64 start = 0;
  for (u32 i = 1; (int)(ld_acquire(c) - target) < 0; ++i) {
    if ((i & 1023u) == 0) {
      if (*(volatile u32*)abort) return;
      if (!start) start = now();
      else if (now() - start > 500000000ull) { *(volatile u32*)abort = 1u; return; }
    }
  }
}
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count)); }
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  asm volatile("{ .reg .pred p; W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;"
               " @!p bra W; }" :: "r"(bar), "r"(parity) : "memory"); }
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory"); }
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               :: "r"(bar), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
               " [%0], [%1], %2, [%3];" :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory"); }
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" :: "n"(NCW * 32) : "memory"); }
// Codes m and m + 4 of a word as two bf16 values 128 + q (the GEMV's unpacking, one LOP3).
__device__ __forceinline__ u32 pair(u32 w, int m) {
  return ((w >> (4 * m)) & 0x000F000Fu) | 0x43004300u; }
#define MMA_OP "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
#define MMA_ACC(a0, a1, a2, a3) \
  asm(MMA_OP "{%8,%9}, {%0,%1,%2,%3};" : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3) \
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(bx), "r"(bx))

#if MMA >= 2
// The tighter loops (docs/notes/persistent_decode.md, "The MMA inner loop's SASS"). The
// constants come from shared memory: given immediates, ptxas rematerializes the mask before
// most LOP3s and copies bx into a fresh register pair before most MMAs (MMA=1: ~20 IMAD.MOV
// a uint4). MMA=3 shifts on the FMA pipe (IMAD.HI by 2^(32-4m)) instead of the ALU pipe,
// which the unpacking's 28 LOP3/SHF a uint4 keep busy alone at MMA=2.
#if MMA == 3
#define SHR(w, m) __umulhi(w, kc[m])  // kc[m] = 2^(32 - 4m)
#else
#define SHR(w, m) ((w) >> (4 * (m)))
#endif
#define PAIR2(w, m) ((m) ? (SHR(w, m) & kmask) | 0x43004300u : ((w) & kmask) | 0x43004300u)
#define MMA_ACC2(a0, a1, a2, a3) \
  asm(MMA_OP "{%8,%9}, {%0,%1,%2,%3};" : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3) \
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))
// One group (a lane's uint4: 64 codes of two rows): the checksum, 4 MMAs into one
// accumulator (C = 0 costs nothing: the first MMA reads RZ), and the scale of the group
// before it (one group late, and across chunks: no warp waits on an MMA chain at a chunk's
// end before it releases the slot). The GEMV's useful column is 0: a lane folds d0 (row g)
// and d2 (row g + 8), as the GEMV's epilogue would.
#define GROUP2(w) do { \
    sum += w.x + w.y + w.z + w.w; \
    float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f; \
    MMA_ACC2(PAIR2(w.x, 0), PAIR2(w.y, 0), PAIR2(w.x, 1), PAIR2(w.y, 1)); \
    MMA_ACC2(PAIR2(w.x, 2), PAIR2(w.y, 2), PAIR2(w.x, 3), PAIR2(w.y, 3)); \
    MMA_ACC2(PAIR2(w.z, 0), PAIR2(w.w, 0), PAIR2(w.z, 1), PAIR2(w.w, 1)); \
    MMA_ACC2(PAIR2(w.z, 2), PAIR2(w.w, 2), PAIR2(w.z, 3), PAIR2(w.w, 3)); \
    f0 = fmaf(q0, qs, f0); f1 = fmaf(q2, qs, f1); \
    q0 = d0; q2 = d2; qs = __uint_as_float((w.w & kmask) | 0x3C000000u); \
  } while (0)
#endif

// A block's sum of one u32 per consumer thread (every consumer thread gets it).
__device__ __forceinline__ u32 consumers_sum(u32 v, u32* red) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int w = threadIdx.x >> 5;
  consumers_sync();
  if ((threadIdx.x & 31) == 0) red[w] = v;
  consumers_sync();
  u32 s = 0;
  for (int i = 0; i < NCW; ++i) s += red[i];
  return s;
}

// The sum of a phase's 4 KB activation, read by the calling warp (L2: written by other SMs).
__device__ __forceinline__ u32 warp_act_sum(const u32* act) {
  u32 s = 0;
  for (int i = threadIdx.x & 31; i < ACT / 4; i += 32) {
    uint4 v = ld_cg4((const uint4*)act + i); s += v.x + v.y + v.z + v.w; }
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

extern "C" __global__ void __launch_bounds__((NCW + 1) * 32, 1)
persistent_stream(const unsigned char* arena, const int4* chunks, const int* first,
                  const long long* fixed_base, const long long* routed_base,
                  const long long* routed_stride, const int* after, const int* fetch,
                  u32* counters, u32* act, u32* epoch, u32* results, u64* trace,
                  float* sink, u32* abort, long long n_phases, long long n_experts,
                  long long mode) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) u64 bars[2 * NSTAGE];
  __shared__ u32 red[NCW];
  __shared__ u32 last_flag;
#if MMA >= 2
  __shared__ u32 kconst[6];  // the loop's constants, opaque to the compiler (see PAIR2)
#endif
  const int P = (int)n_phases, b = blockIdx.x, nb = gridDim.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const u32 e = *(volatile u32*)epoch + 1u, target = e * (u32)nb;
  const int* my_first = first + (long long)b * (P + 1);
  if (threadIdx.x == 0) {
    for (int s = 0; s < NSTAGE; ++s) {
      mbar_init(smem_u32(&bars[s]), 1);
      mbar_init(smem_u32(&bars[NSTAGE + s]), NCW);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#if MMA >= 2
    kconst[0] = 0x000F000Fu; kconst[1] = 0u;
    kconst[2] = 1u << 28; kconst[3] = 1u << 24; kconst[4] = 1u << 20;
#endif
  }
  __syncthreads();

  if (warp == NCW) {  // ---- producer: the block's chunks into the ring, in order
    int k = 0;
    for (int p = 0; p < P; ++p) {
      const int lo = my_first[p], hi = my_first[p + 1];
      if (lo == hi) continue;
      if (mode == 2 && after[p] >= 0 && lane == 0)
        wait_count(counters + after[p] * CPAD, target, abort);
      u32 route = 0;
      if (fetch[p] >= 0) {  // the routing: known once the router phase is complete
        if (mode != 0 && lane == 0) wait_count(counters + fetch[p] * CPAD, target, abort);
        __syncwarp();
        route = warp_act_sum(act + (long long)fetch[p] * ACT);
      }
      if (lane == 0) {
        for (int i = lo; i < hi; ++i, ++k) {
          const int4 c = chunks[i];
          const long long off = ((long long)(u32)c.y << 32) | (u32)c.x;
          const long long expert = (route + 37u * (u32)c.w) % (u32)n_experts;
          const unsigned char* src = c.w < 0 ? arena + fixed_base[p] + off
              : arena + routed_base[p] + expert * routed_stride[p] + off;
          const int s = k % NSTAGE;
          mbar_wait(smem_u32(&bars[NSTAGE + s]), ((k / NSTAGE) & 1) ^ 1);
          bulk_load(smem_u32(smem + (long long)s * CHUNK), src, (u32)c.z, smem_u32(&bars[s]));
        }
      } else {
        k += hi - lo;
      }
      __syncwarp();
    }
    return;
  }

  // ---- consumers
  const int t = threadIdx.x;
  int k = 0;
  float f0 = 0.f, f1 = 0.f;
#if MMA >= 2
  const u32 kmask = *(volatile u32*)&kconst[0], kzero = *(volatile u32*)&kconst[1];
#if MMA == 3
  const u32 kc[4] = {1u, *(volatile u32*)&kconst[2], *(volatile u32*)&kconst[3],
                     *(volatile u32*)&kconst[4]};
#endif
  float q0 = 0.f, q2 = 0.f, qs = 0.f;  // the group whose scale is pending
#endif
  for (int p = 0; p < P; ++p) {
    u64 t0 = 0, t1 = 0;
    if (TRACE && t == 0) t0 = now();
    const int dep = after[p];
    u32 a_in = e;
    if (dep >= 0) {
      if (mode != 0 && t == 0) wait_count(counters + dep * CPAD, target, abort);
      consumers_sync();
      if (TRACE && t == 0) t1 = now();
      u32 part = 0;
      for (int i = t; i < ACT / 4; i += NCW * 32) {
        const uint4 v = ld_cg4((const uint4*)(act + (long long)dep * ACT) + i);
        part += v.x + v.y + v.z + v.w;
      }
      a_in = consumers_sum(part, red);
    } else if (TRACE && t == 0) {
      t1 = now();
    }
    u32 sum = 0;
    const u32 bx = 0x3F803F80u ^ (a_in & 0x00070007u);
#if MMA >= 2
    const u32 b0 = bx, b1 = bx ^ kzero;  // two registers: the MMA's B pair, allocated once
#endif
    for (int i = my_first[p]; i < my_first[p + 1]; ++i, ++k) {
      const int s = k % NSTAGE;
      const int bytes = chunks[i].z;
      mbar_wait(smem_u32(&bars[s]), (k / NSTAGE) & 1);
      const uint4* src = (const uint4*)(smem + (long long)s * CHUNK);
#if MMA >= 2
      // A full chunk: a trip count known to the compiler, no bounds test. Otherwise the
      // warp's full rows of 32 uint4 with none, then at most one row with the test (a lane
      // past the chunk reads zeros: mma.sync.aligned needs every lane).
      constexpr int ROW = NCW * 32, FULL_IT = CHUNK / 16 / ROW;
      if (CHUNK % (16 * ROW) == 0 && bytes == CHUNK) {
#pragma unroll
        for (int it = 0; it < FULL_IT; ++it) { const uint4 w = src[t + it * ROW]; GROUP2(w); }
      } else {
        const int n16 = bytes / 16;
        int j0 = t - lane;
#pragma unroll 2
        for (; j0 + 32 <= n16; j0 += ROW) { const uint4 w = src[j0 + lane]; GROUP2(w); }
        if (j0 < n16) {
          const uint4 w = j0 + lane < n16 ? src[j0 + lane] : make_uint4(0u, 0u, 0u, 0u);
          GROUP2(w);
        }
      }
#else
      // The loop runs warp by warp (a lane past the chunk reads zeros): mma.sync.aligned
      // needs every lane of the warp at the same instruction, and a chunk of fewer than
      // 16 * 32 bytes a warp left lanes out (its GPU test with 64-byte chunks hung on the H200).
#pragma unroll 4
      for (int j0 = t - lane; j0 < bytes / 16; j0 += NCW * 32) {
        const int j = j0 + lane;
        const uint4 w = j < bytes / 16 ? src[j] : make_uint4(0u, 0u, 0u, 0u);
        sum += w.x + w.y + w.z + w.w;
#if MMA
        // a group of 64 codes of two rows: four MMAs into one accumulator (as the GEMV)
        float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
        MMA_ACC(pair(w.x, 0), pair(w.y, 0), pair(w.x, 1), pair(w.y, 1));
        MMA_ACC(pair(w.x, 2), pair(w.y, 2), pair(w.x, 3), pair(w.y, 3));
        MMA_ACC(pair(w.z, 0), pair(w.w, 0), pair(w.z, 1), pair(w.w, 1));
        MMA_ACC(pair(w.z, 2), pair(w.w, 2), pair(w.z, 3), pair(w.w, 3));
        // the group's scale and bias, as the GEMV applies them to its MMA result
        const float sc = __uint_as_float((w.w & 0x007F0000u) | 0x3C000000u);
        f0 = fmaf(d0 + d1, sc, f0);
        f1 = fmaf(d2 + d3, sc, f1);
#endif
      }
#endif
      __syncwarp();
      if (lane == 0) mbar_arrive(smem_u32(&bars[NSTAGE + s]));
    }
    const u32 r = consumers_sum(sum, red) + a_in;
    if (t == 0) {
      act[(long long)p * ACT + b] = r;
      if (TRACE) {
        u64* tr = trace + ((long long)b * P + p) * 3;
        tr[0] = t0; tr[1] = t1; tr[2] = now();
      }
      if (p < P - 1) {
        asm volatile("fence.acq_rel.gpu; red.relaxed.gpu.global.add.u32 [%0], 1;"
                     :: "l"(counters + p * CPAD) : "memory");
      } else {
        u32 old;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                     : "=r"(old) : "l"(counters + p * CPAD) : "memory");
        last_flag = (old == target - 1u);
      }
    }
  }
  consumers_sync();
  if (last_flag && warp == 0) {  // the last block: the step's final value, then the epoch
    const u32 fin = warp_act_sum(act + (long long)(P - 1) * ACT);
    if (lane == 0) { results[e % RESULTS] = fin; __threadfence(); *(volatile u32*)epoch = e; }
  }
#if MMA >= 2
  f0 = fmaf(q0, qs, f0); f1 = fmaf(q2, qs, f1);  // the last group's scale
#endif
  if (__float_as_uint(f0) == 0x7fc00001u) sink[t] = f1;  // keeps the arithmetic
}
"""


@dataclass
class Stream:
    """A plan laid out on the device: the arena (every phase's fixed bytes and all experts
    of every routed phase, random), the kernel's tables and the host's sums of every
    region (for ``expected_final``)."""

    phases: list[Phase]
    blocks: int
    chunk: int  # bytes a copy at most: a ring slot's size
    n_experts: int
    arena: torch.Tensor
    tables: dict[str, torch.Tensor]
    fixed_sum: list[int]
    expert_sums: list[list[int]]  # per phase: the sum of each expert's region (routed phases)

    @property
    def read_bytes(self) -> int:
        return sum(ph.read_bytes for ph in self.phases)


def _sum32(t: torch.Tensor) -> torch.Tensor:
    # Sums of int32 words as uint32 mod 2^32 (int64 sums cannot overflow at these sizes).
    return t.view(torch.int32).to(torch.int64).sum(-1) % (1 << 32)


def build(phases: list[Phase], blocks: int, chunk: int, n_experts: int, device="cuda",
          seed: int = 0) -> Stream:  # fmt: skip
    """The arena and tables of ``phases`` for ``blocks`` blocks copying ``chunk`` bytes at
    most at a time."""
    per_block = split_chunks(phases, blocks, chunk)
    fixed_base, routed_base, stride, pos = [], [], [], 0
    for ph in phases:
        fixed_base.append(pos)
        pos += -(-ph.fixed_bytes // 128) * 128
        routed_base.append(pos)
        stride.append(ph.per_slot)
        pos += n_experts * ph.per_slot
    g = torch.Generator(device=device).manual_seed(seed)
    arena = torch.empty(max(pos, 16) // 4, dtype=torch.int32, device=device)
    arena.random_(generator=g)
    arena = arena.view(torch.uint8)
    fixed_sum, expert_sums = [], []
    for p, ph in enumerate(phases):
        w = arena[fixed_base[p] : fixed_base[p] + ph.fixed_bytes]
        fixed_sum.append(int(_sum32(w)) if ph.fixed_bytes else 0)
        if ph.slots:
            region = arena[routed_base[p] : routed_base[p] + n_experts * ph.per_slot]
            expert_sums.append(_sum32(region.view(n_experts, -1).view(torch.int32)).tolist())
        else:
            expert_sums.append([])
    rows, first = [], []
    for cl in per_block:
        phase_of = [c.phase for c in cl]  # ascending: split_chunks lists a block's in order
        first.append([len(rows) + bisect.bisect_left(phase_of, p) for p in range(len(phases) + 1)])
        rows += [(c.offset & 0xFFFFFFFF, c.offset >> 32, c.nbytes, c.slot) for c in cl]
    as_i32 = [[v - (1 << 32) if v >= 1 << 31 else v for v in r] for r in rows] or [[0, 0, 0, 0]]

    def dev(x, dt):
        return torch.tensor(x, dtype=dt, device=device)

    tables = {
        "chunks": dev(as_i32, torch.int32),
        "first": dev(first, torch.int32),
        "fixed_base": dev(fixed_base, torch.int64),
        "routed_base": dev(routed_base, torch.int64),
        "routed_stride": dev(stride, torch.int64),
        "after": dev([ph.after for ph in phases], torch.int32),
        "fetch": dev([ph.fetch_after for ph in phases], torch.int32),
    }
    return Stream(phases, blocks, chunk, n_experts, arena, tables, fixed_sum, expert_sums)


def expected_final(st: Stream, epoch: int) -> int:
    """The last phase's activation sum for the step of ``epoch`` (1-based), on the host."""
    m = 1 << 32
    a: list[int] = []
    for p, ph in enumerate(st.phases):
        inp = a[ph.after] if ph.after >= 0 else epoch % m
        s = st.fixed_sum[p]
        if ph.slots:
            route = a[ph.fetch_after]
            for j in range(ph.slots):
                s += st.expert_sums[p][(route + 37 * j) % m % st.n_experts]
        a.append((s + st.blocks * inp) % m)
    return a[-1]


@dataclass
class Runner:
    """One compiled variant over a Stream, with its own counters, activations and epoch."""

    st: Stream
    kernel: cuda_rtc.Kernel
    warps: int
    mode: int
    buffers: dict[str, torch.Tensor]

    def launch(self) -> None:
        t, b = self.st.tables, self.buffers
        self.kernel.launch(self.st.blocks, (self.warps + 1) * 32, [
            self.st.arena, t["chunks"], t["first"], t["fixed_base"], t["routed_base"],
            t["routed_stride"], t["after"], t["fetch"], b["counters"], b["act"], b["epoch"],
            b["results"], b["trace"], b["sink"], b["abort"], len(self.st.phases),
            self.st.n_experts, self.mode,
        ])  # fmt: skip

    @property
    def aborted(self) -> bool:
        """Whether a wait gave up (the protocol is broken: the values are wrong)."""
        return bool(self.buffers["abort"].item())

    def results(self) -> list[int]:
        """The final values of the steps so far (epoch 1..), as uint32."""
        n = int(self.buffers["epoch"].item())
        r = self.buffers["results"].tolist()
        return [r[e % RESULTS] % (1 << 32) for e in range(1, min(n, RESULTS - 1) + 1)]


def options(chunk: int, *, stages: int, warps: int = 8, mma: int = 0,
            trace: bool = False) -> tuple[str, ...]:  # fmt: skip
    """The kernel's compile-time options (NVRTC ``-D`` flags)."""
    if int(mma) not in MMA_LOOPS:
        raise ValueError(f"persistent_stream: mma must be one of {sorted(MMA_LOOPS)}, got {mma}")
    return tuple(f"-D{k}={v}" for k, v in (("NSTAGE", stages), ("CHUNK", chunk), ("NCW", warps),
                                           ("MMA", int(mma)), ("TRACE", int(trace)),
                                           ("ACT", ACT), ("RESULTS", RESULTS)))  # fmt: skip


def runner(st: Stream, mode: int, *, stages: int, warps: int = 8, mma: int = 0,
           trace: bool = False) -> Runner:  # fmt: skip
    """A compiled variant: ``mode`` 0 (no waits), 1 (counters, prefetch across phases) or 2
    (counters, a phase's copies only after its input is complete); ``mma`` the consumer's
    arithmetic (MMA_LOOPS; True is 1)."""
    if mode not in (0, 1, 2):
        raise ValueError(f"persistent_stream: mode must be 0, 1 or 2, got {mode}")
    smem = stages * st.chunk
    opts = options(st.chunk, stages=stages, warps=warps, mma=mma, trace=trace)
    kernel = cuda_rtc.load(SOURCE, "persistent_stream", smem=smem, options=opts)
    dev = st.arena.device
    n = len(st.phases)
    bufs = {
        "counters": torch.zeros(n * 32, dtype=torch.int32, device=dev),  # CPAD apart
        "act": torch.zeros(n * ACT, dtype=torch.int32, device=dev),
        "epoch": torch.zeros(1, dtype=torch.int32, device=dev),
        "results": torch.zeros(RESULTS, dtype=torch.int32, device=dev),
        "trace": torch.zeros(st.blocks * n * 3 if trace else 1, dtype=torch.int64, device=dev),
        "sink": torch.zeros((warps + 1) * 32, dtype=torch.float32, device=dev),
        "abort": torch.zeros(1, dtype=torch.int32, device=dev),
    }
    return Runner(st, kernel, warps, mode, bufs)
