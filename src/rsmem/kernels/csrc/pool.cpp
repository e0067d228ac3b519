// rsmem::pool (pool.h): the workers, their wait, and the ops that set and show them.
//
// One job at a time (a dispatch lock; a second caller uses at::parallel_for). A job is published as a
// ticket (epoch << 8 | threads) after its fields; a worker with index < threads - 1 enters it through
// `gate` ([epoch:32 | closed:1 | active:31]), which only lets it in while the job is open and of its epoch,
// claims ranges from `next` until none is left, and leaves. The caller claims ranges too, then closes the
// gate and waits for the workers inside to leave: a worker that wakes later finds the gate closed (or of
// another epoch) and never touches the finished job, which lives on the caller's stack.
//
// State is never destroyed (the workers are detached and may be asleep at exit). After fork() the child
// starts a new pool: the parent's workers do not exist there.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "pool.h"

namespace rsmem {
namespace pool {
namespace {

constexpr uint64_t kClosed = uint64_t{1} << 31;
constexpr uint64_t kActive = kClosed - 1;
constexpr int kMaxThreads = 255;  // the ticket's low byte
// A yield this long ran a neighbour: beside a CPU-bound process a yield lasts its slice (a millisecond or
// more); on a quiet machine yields run kernel threads for tens of microseconds, now and then hundreds, and a
// bound under those would read each as a neighbour and stop the spin for kBusyHold.
constexpr std::chrono::microseconds kBusyYield{250};
constexpr int64_t kCheckEvery = 1000000;             // ns between two reads of the preemption count
constexpr int64_t kWindow = 20000000;                // ns: preemptions are counted over windows this long
constexpr long kBusyCount = 3;                       // at least this many in a window
constexpr long kBusyRate = 100;                      // and at least this many a second mean a busy core
constexpr int64_t kBusyHold = 50000000;              // ns without spinning after that

struct Job {
  RangeFn fn;
  void* ctx;
  int64_t begin, end, size, chunks;
  std::atomic<int64_t> next{0};
  std::mutex error_mu;
  std::exception_ptr error;
};

struct Pool {
  pid_t pid = getpid();
  std::mutex dispatch;  // one job at a time
  std::atomic<uint64_t> ticket{0};
  std::atomic<uint64_t> gate{kClosed};
  std::atomic<Job*> job{nullptr};
  std::mutex sleep_mu;
  std::condition_variable wake;
  std::atomic<int> sleepers{0};
  int workers = 0;  // started (under `dispatch`)
  uint64_t epoch = 0;
  std::atomic<int64_t> jobs{0};
  std::atomic<int64_t> checked_ns{0};     // preempted_lately's last read
  std::atomic<int64_t> window_ns{0};      // when its window began
  std::atomic<long> window_nivcsw{0};     // and the count then
  std::atomic<int64_t> busy_until_ns{0};  // no spinning before this
};

std::atomic<int64_t> g_spin_us{200};  // set_pool; < 0: off
std::atomic<Pool*> g_pool{nullptr};
thread_local bool t_in_job = false;

inline void relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

void work(Job& j) {
  for (;;) {
    const int64_t c = j.next.fetch_add(1, std::memory_order_relaxed);
    if (c >= j.chunks) return;
    const int64_t b = j.begin + c * j.size;
    const int64_t e = std::min(j.end, b + j.size);
    try {
      j.fn(j.ctx, b, e);
    } catch (...) {
      std::lock_guard<std::mutex> lk(j.error_mu);
      if (!j.error) j.error = std::current_exception();
      j.next.store(j.chunks, std::memory_order_relaxed);  // the others stop claiming
    }
  }
}

// Whether this process was preempted lately: its threads' involuntary context switches (getrusage, read at
// most once a millisecond) came at kBusyRate a second or more over a window of at least kWindow, within the
// last kBusyHold. Beside a busy neighbour every slice ends that way; a spinning worker
// then only delays itself (a runnable thread waits for the other's slice, a sleeper woken has the
// scheduler's preference). A quiet machine preempts too, now and then (kernel threads,
// timers), and reading any single one as a neighbour would stop the spin for kBusyHold at a time: a
// one-sequence step would then sleep and wake its worker for most of its products, slower than spinning.
int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool preempted_lately(Pool& p) {
  const int64_t now = now_ns();
  if (now - p.checked_ns.load(std::memory_order_relaxed) >= kCheckEvery) {
    p.checked_ns.store(now, std::memory_order_relaxed);
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) == 0) {
      const int64_t began = p.window_ns.load(std::memory_order_relaxed);
      const long switches = ru.ru_nivcsw - p.window_nivcsw.load(std::memory_order_relaxed);
      if (now - began >= kWindow) {
        if (switches >= kBusyCount && switches * 1000000000 >= kBusyRate * (now - began))
          p.busy_until_ns.store(now + kBusyHold, std::memory_order_relaxed);
        p.window_ns.store(now, std::memory_order_relaxed);
        p.window_nivcsw.store(ru.ru_nivcsw, std::memory_order_relaxed);
      }
    }
  }
  return now < p.busy_until_ns.load(std::memory_order_relaxed);
}

// Waits until the ticket's epoch differs from `seen`: spins (pause, then sched_yield) for spin_us unless
// the process was preempted lately or a yield ran another thread, then sleeps.
uint64_t wait_ticket(Pool& p, uint64_t seen) {
  using clock = std::chrono::steady_clock;
  auto t0 = clock::now();
  bool spin = g_spin_us.load(std::memory_order_relaxed) > 0 && !preempted_lately(p);
  for (unsigned it = 1;; ++it) {
    const uint64_t t = p.ticket.load(std::memory_order_acquire);
    if ((t >> 8) != seen) return t;
    if ((it & 15) != 0) {
      relax();
      continue;
    }
    const auto now = clock::now();
    if (spin && now - t0 < std::chrono::microseconds(g_spin_us.load(std::memory_order_relaxed))) {
      sched_yield();  // returns at once unless another thread wants this core
      if (clock::now() - now < kBusyYield) continue;
      p.busy_until_ns.store(now_ns() + kBusyHold, std::memory_order_relaxed);  // it ran another thread
    }
    std::unique_lock<std::mutex> lk(p.sleep_mu);
    p.sleepers.fetch_add(1, std::memory_order_seq_cst);
    while ((p.ticket.load(std::memory_order_seq_cst) >> 8) == seen) p.wake.wait(lk);
    p.sleepers.fetch_sub(1, std::memory_order_relaxed);
    t0 = clock::now();
    spin = g_spin_us.load(std::memory_order_relaxed) > 0 && !preempted_lately(p);
  }
}

void worker_main(Pool* p, int index) {
  t_in_job = true;  // a range's own parallel_for runs inline
  uint64_t seen = p->ticket.load(std::memory_order_acquire) >> 8;
  for (;;) {
    const uint64_t t = wait_ticket(*p, seen);
    seen = t >> 8;
    if (index >= static_cast<int>(t & 0xff) - 1) continue;  // not one of this job's threads
    const uint64_t epoch_bits = (seen & 0xffffffffu) << 32;
    uint64_t g = p->gate.load(std::memory_order_acquire);
    bool entered = false;
    while ((g & ~(kClosed | kActive)) == epoch_bits && !(g & kClosed)) {
      if (p->gate.compare_exchange_weak(g, g + 1, std::memory_order_acq_rel)) {
        entered = true;
        break;
      }
    }
    if (!entered) continue;  // finished before this worker woke
    work(*p->job.load(std::memory_order_acquire));
    p->gate.fetch_sub(1, std::memory_order_release);
  }
}

// The pool of this process, made at its first use, or anew in a child after fork() (the parent's workers
// do not exist there; its pool is left). Installed by compare-and-swap, no lock: a lock held by another
// thread at the moment of a fork() would stay locked in the child forever.
Pool& current() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  while (p == nullptr || p->pid != getpid()) {
    Pool* fresh = new Pool();
    if (g_pool.compare_exchange_strong(p, fresh, std::memory_order_acq_rel)) return *fresh;
    delete fresh;  // another thread installed one first: p is that one now
  }
  return *p;
}

}  // namespace

bool in_job() { return t_in_job; }

bool run(RangeFn fn, void* ctx, int64_t begin, int64_t end, int64_t chunks, int threads) {
  if (g_spin_us.load(std::memory_order_relaxed) < 0 || t_in_job || at::in_parallel_region()) return false;
  Pool& p = current();
  std::unique_lock<std::mutex> lk(p.dispatch, std::try_to_lock);
  if (!lk.owns_lock()) return false;
  threads = std::min(threads, kMaxThreads);
  try {
    while (p.workers < threads - 1) {
      std::thread(worker_main, &p, p.workers).detach();
      ++p.workers;
    }
  } catch (const std::system_error&) {  // no more threads: the ones there are
    if (p.workers == 0) return false;
    threads = p.workers + 1;
  }
  Job j;
  j.fn = fn;
  j.ctx = ctx;
  j.begin = begin;
  j.end = end;
  j.size = (end - begin + chunks - 1) / chunks;
  j.chunks = (end - begin + j.size - 1) / j.size;
  const uint64_t epoch = ++p.epoch;
  p.job.store(&j, std::memory_order_release);
  p.gate.store((epoch & 0xffffffffu) << 32, std::memory_order_release);
  p.ticket.store((epoch << 8) | static_cast<uint64_t>(threads), std::memory_order_seq_cst);
  if (p.sleepers.load(std::memory_order_seq_cst) > 0) {
    { std::lock_guard<std::mutex> sl(p.sleep_mu); }
    p.wake.notify_all();
  }
  t_in_job = true;
  work(j);
  t_in_job = false;
  p.gate.fetch_or(kClosed, std::memory_order_acq_rel);
  for (unsigned it = 1; (p.gate.load(std::memory_order_acquire) & kActive) != 0; ++it) {
    if ((it & 15) == 0) {
      sched_yield();
    } else {
      relax();
    }
  }
  p.jobs.fetch_add(1, std::memory_order_relaxed);
  if (j.error) std::rethrow_exception(j.error);
  return true;
}

namespace {

// The previous setting; spin_us < 0 turns the pool off (at::parallel_for for every range).
int64_t set_pool(int64_t spin_us) { return g_spin_us.exchange(spin_us); }

// [spin_us, jobs run by the pool, workers started] in this process.
std::vector<int64_t> pool_stats() {
  Pool& p = current();
  return {g_spin_us.load(), p.jobs.load(), static_cast<int64_t>(p.workers)};
}

// For the tests: parallel_for over [0, n) with `grain`; out[i] counts the visits of i (each must be 1).
// A range that holds `throw_at` throws (the error must reach the caller); `nested` runs a parallel_for
// inside each range.
at::Tensor pool_cover(int64_t n, int64_t grain, int64_t throw_at, bool nested) {
  at::Tensor out = at::zeros({n}, at::kLong);
  auto* visits = reinterpret_cast<std::atomic<int64_t>*>(out.data_ptr<int64_t>());
  parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
    if (b <= throw_at && throw_at < e) throw std::runtime_error("pool_cover: range " + std::to_string(b));
    if (nested) {
      parallel_for(b, e, 1, [&](int64_t nb, int64_t ne) {
        for (int64_t i = nb; i < ne; ++i) visits[i].fetch_add(1, std::memory_order_relaxed);
      });
    } else {
      for (int64_t i = b; i < e; ++i) visits[i].fetch_add(1, std::memory_order_relaxed);
    }
  });
  return out;
}

}  // namespace
}  // namespace pool
}  // namespace rsmem

TORCH_LIBRARY_FRAGMENT(RSMEM_OPS_NS, m) {
  m.def("set_pool(int spin_us) -> int", &rsmem::pool::set_pool);
  m.def("pool_stats() -> int[]", &rsmem::pool::pool_stats);
  m.def("pool_cover(int n, int grain, int throw_at=-1, bool nested=False) -> Tensor", &rsmem::pool::pool_cover);
}
