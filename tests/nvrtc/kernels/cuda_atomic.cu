// libcu++ cuda::atomic_ref on global memory: fetch_add, fetch_max,
// exchange, compare_exchange_strong with explicit memory orders and scopes.
#include <cuda/atomic>
#include "common.cuh"

extern "C" __global__ void atomic_ref_ops(int* cells, u64* wide, int* olds, int n) {
    int t = gid();
    if (t >= n) return;
    cuda::atomic_ref<int, cuda::thread_scope_device> a0(cells[0]), a1(cells[1]), a2(cells[2]), a3(cells[3]);
    a0.fetch_add(t, cuda::memory_order_relaxed);
    a1.fetch_max(t * 7 % 101, cuda::memory_order_acq_rel);
    olds[t] = a2.exchange(t, cuda::memory_order_seq_cst);
    int expected = 0;
    a3.compare_exchange_strong(expected, t + 1000, cuda::memory_order_acq_rel, cuda::memory_order_acquire);
    cuda::atomic_ref<u64, cuda::thread_scope_system> w(wide[0]);
    w.fetch_add(1ull << 32, cuda::memory_order_release);
    cuda::atomic_ref<u64, cuda::thread_scope_block> w1(wide[1]);
    w1.fetch_or(1ull << (t & 63), cuda::memory_order_relaxed);
    cuda::atomic_thread_fence(cuda::memory_order_seq_cst, cuda::thread_scope_device);
}
