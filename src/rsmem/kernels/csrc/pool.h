// rsmem's own workers for the decode products (rows_kernel.h, the quantized routes for few rows), with a
// wait that spins only while the core is otherwise idle.
//
// Why: torch's OpenMP threads either spin after each parallel region (libgomp's default; beside a busy
// neighbour a spinning thread holds the core its partner needs, and steps take many times longer) or sleep at
// once (rsmem's OMP_WAIT_POLICY=PASSIVE), so that each of a decode step's ~100 products wakes the worker
// through the kernel first (a futex wake and, on a quiet machine, a core leaving its idle state): a quiet
// machine's one-sequence decode loses a large share of its speed to that against a short spin. libgomp's spin
// cannot see a neighbour. Here an idle worker waits for the next product in a loop that calls sched_yield
// between short bursts of `pause`: on a core with nothing else to run the call returns at once and the worker
// keeps spinning; where another thread is runnable on that core (a neighbour, the caller, the server's event
// loop) the scheduler runs that one instead. After `spin_us` microseconds without work the worker sleeps on a
// condition variable; spin_us 0 sleeps at once (OpenMP's passive wait), and a negative spin_us (set_pool)
// hands every range back to at::parallel_for (torch's OpenMP threads), the reference this is checked against.
//
// rsmem::pool::parallel_for(begin, end, grain, f) is at::parallel_for's contract: f(b, e) over disjoint
// ranges covering [begin, end), each at least `grain` long but the last, on torch.get_num_threads()
// threads (the caller and num_threads - 1 workers); the first exception thrown is rethrown in the caller. The
// caller takes ranges too, so a product whose worker is still waking up is done by the caller alone. Nested
// calls, calls inside an OpenMP region and a second caller while one dispatches run their ranges as
// at::parallel_for would.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>
#include <utility>

namespace rsmem {
namespace pool {

using RangeFn = void (*)(void* ctx, int64_t begin, int64_t end);

// Runs fn over [begin, end) in `chunks` pieces on `threads` threads; false when the pool cannot take it
// now (off, nested, another caller dispatching), and then nothing ran.
bool run(RangeFn fn, void* ctx, int64_t begin, int64_t end, int64_t chunks, int threads);

// Whether this thread is running one of the pool's ranges (a worker, or a caller inside its own job).
bool in_job();

// Ranges of at least `grain` (as at::parallel_for's), a multiple of `threads` where the range allows (an
// equal share each) and up to 4 a thread, so that a worker that wakes late leaves its share to the others.
inline int64_t chunk_count(int64_t range, int64_t grain, int threads) {
  const int64_t g = grain < 1 ? 1 : grain;
  const int64_t by_grain = (range + g - 1) / g;
  if (by_grain <= threads) return by_grain;
  const int64_t per = by_grain / threads;
  return static_cast<int64_t>(threads) * (per < 4 ? per : 4);
}

template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  if (in_job()) {  // nested: this range's threads are busy already
    f(begin, end);
    return;
  }
  const int threads = at::get_num_threads();
  const int64_t chunks = chunk_count(end - begin, grain, threads);
  if (threads > 1 && chunks > 1) {
    auto call = [](void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); };
    if (run(call, const_cast<void*>(static_cast<const void*>(&f)), begin, end, chunks, threads)) return;
  }
  at::parallel_for(begin, end, grain, f);
}

}  // namespace pool
}  // namespace rsmem
