// plow native kernel — the host build: one persistent step over CPU threads.
//
// A plan's worker queues are the records' `worker` fields in file order. A dispatch runs every
// queue to its end: a record waits until its counter has reached its threshold (acquire), runs
// its units, then increments its signal counter (release). Counters only grow: step s of a plan
// waits for `signals_per_step * (s - 1) + threshold`, so nothing is reset between steps (for a
// certified plan threshold = signals_per_step, i.e. `threshold * s`, as Mirage's persistent
// kernel does). With fewer threads than workers a thread owns several queues and advances
// whichever can move; the arithmetic of every tile is fixed, so the bytes do not depend on the
// thread count. The GIL is not involved: the Python side calls in through ctypes, which releases
// it for the whole call.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define PLOW_PAUSE() _mm_pause()
#else
#define PLOW_PAUSE() ((void)0)
#endif

// Hot loops are compiled for x86-64-v4 (AVX-512), v3 (AVX2 + FMA) and plain x86-64 and picked at
// load time (ifunc);
// the lanes and the reduction tree are spelled out in the source, so every clone gives the
// same bits.
#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
#define PLOW_SIMD \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
#if defined(__x86_64__)
#define PLOW_X86_BLOCKS 1  // kernels/blocks.h: AVX2 spellings of the quantized dots
#endif
#include "interp.h"
#include "sampler.h"

namespace {

struct alignas(64) Counter {
  std::atomic<uint64_t> v{0};
};

struct HostPlan {
  PlowPlan p;
  std::vector<PlowOp> ops;
  std::vector<plow::Record> recs;
  std::vector<std::vector<int64_t>> queues;
  std::vector<uint64_t> per_step;  // signals per step of each counter
  Counter* counters = nullptr;
  uint64_t step = 0;
  int64_t scratch_floats = 0;
  int64_t last_tasks = 0, last_nops = 0, last_threads = 0;
  std::atomic<bool> abort{false};
  std::atomic<int64_t> tasks_run{0}, nops_run{0};
  bool profile = false;                  // per-op nanoseconds of task packets (plow_plan_profile)
  std::vector<std::atomic<int64_t>> op_ns;
  std::vector<std::atomic<int64_t>> op_work;  // counted work per op in the last dispatch
  std::string stuck;
  std::mutex stuck_mu;
  // Blocked threads spin, then yield, then sleep until some counter moves (bounded naps, so a
  // missed wake-up costs at most a nap): an oversubscribed machine is not burnt by spinners.
  std::atomic<int> sleepers{0};
  std::atomic<uint64_t> epoch{0};
  std::mutex sleep_mu;
  std::condition_variable sleep_cv;
  // Work-conserving queues: a queue is advanced by whichever thread holds its claim (its own
  // thread first; a blocked thread takes another's queue), so a thread the OS deschedules
  // while waiting does not stall the others. Each record computes the same bits on any thread.
  struct alignas(64) Queue {
    std::atomic<bool> busy{false};
    std::atomic<size_t> at{0};  // next record; written only under the claim
  };
  std::unique_ptr<Queue[]> qs;
  std::atomic<int64_t> queues_left{0};
};

constexpr uint64_t kSpins = 2048, kYields = 64;
constexpr auto kNap = std::chrono::milliseconds(20);

void set_err(char* err, int64_t len, const std::string& msg) {
  if (err == nullptr || len <= 0) return;
  const size_t n = std::min<size_t>(msg.size(), static_cast<size_t>(len - 1));
  memcpy(err, msg.data(), n);
  err[n] = 0;
}

bool supported(uint32_t opcode) {
  return opcode <= PLOW_OP_SAMPLE || opcode == plow::PLOW_OP_ROUTER ||
         opcode == plow::PLOW_OP_EXPERT_LINEAR || opcode == plow::PLOW_OP_ALLREDUCE ||
         (opcode >= plow::PLOW_OP_SSM_CONV && opcode <= plow::PLOW_OP_SSM_NORM) ||
         opcode == plow::PLOW_OP_KDA;
}

// -- the thread pool: threads stay up between steps; a step is one generation --------------
struct Pool {
  std::vector<std::thread> threads;
  std::mutex mu;
  std::condition_variable cv;
  uint64_t gen = 0;
  int active = 0;  // helper threads taking part in the current generation
  std::atomic<int> pending{0};
  void (*job)(void*, int) = nullptr;
  void* arg = nullptr;
  bool quit = false;

  void grow(int n) {
    while (static_cast<int>(threads.size()) < n) {
      const int id = static_cast<int>(threads.size()) + 1;  // thread 0 is the caller
      threads.emplace_back([this, id] { loop(id); });
    }
  }
  void loop(int id) {
    uint64_t seen = 0;
    for (;;) {
      void (*j)(void*, int);
      void* a;
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return quit || (gen != seen && id <= active); });
        if (quit) return;
        seen = gen;
        j = job;
        a = arg;
      }
      j(a, id);
      pending.fetch_sub(1, std::memory_order_acq_rel);
    }
  }
  void run(int n, void (*j)(void*, int), void* a) {
    grow(n - 1);
    {
      std::lock_guard<std::mutex> lk(mu);
      job = j;
      arg = a;
      active = n - 1;
      pending.store(n - 1, std::memory_order_release);
      ++gen;
    }
    cv.notify_all();
    j(a, 0);
    for (int spin = 0; pending.load(std::memory_order_acquire) != 0; ++spin) {
      if (spin < 4096) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu);
      quit = true;
    }
    cv.notify_all();
    for (auto& t : threads) t.join();
  }
};

Pool& pool() {
  static Pool p;
  return p;
}
std::mutex dispatch_mu;  // one step at a time per process (the pool is shared)

struct StepArgs {
  HostPlan* hp;
  float* arena;
  int threads;
  int64_t timeout_ms;
};

void worker_thread(void* argp, int tid) {
  auto* sa = static_cast<StepArgs*>(argp);
  HostPlan& hp = *sa->hp;
  const plow::Ctx ctx{sa->arena, &hp.p};
  std::vector<float> scratch(static_cast<size_t>(hp.scratch_floats) + 16);
  std::vector<int> mine;
  for (int w = tid; w < static_cast<int>(hp.queues.size()); w += sa->threads) mine.push_back(w);
  const int nq = static_cast<int>(hp.queues.size());
  std::vector<int> others;  // the other threads' queues, taken when all of this thread's block
  for (int w = 0; w < nq; ++w)
    if (w % sa->threads != tid) others.push_back(w);
  const uint64_t s = hp.step;
  int64_t tasks = 0, nops = 0;
  uint64_t spins = 0;
  auto last = std::chrono::steady_clock::now();  // the last time this thread moved
  auto ready_at = [&](int w, size_t at) {
    const auto& q = hp.queues[w];
    if (at >= q.size()) return false;
    const plow::Record& r = hp.recs[q[at]];
    if (r.wait_counter == PLOW_NO_COUNTER) return true;
    const uint64_t want = hp.per_step[r.wait_counter] * (s - 1) + r.wait_threshold;
    return hp.counters[r.wait_counter].v.load(std::memory_order_seq_cst) >= want;
  };
  auto ready = [&](int w) { return ready_at(w, hp.qs[w].at.load(std::memory_order_relaxed)); };
  // Runs queue w's ready records under its claim; false when it could not run any.
  auto advance = [&](int w) {
    if (!ready(w)) return false;
    auto& qs = hp.qs[w];
    if (qs.busy.exchange(true, std::memory_order_acquire)) return false;
    const auto& q = hp.queues[w];
    size_t at = qs.at.load(std::memory_order_relaxed);
    bool ran = false;
    while (ready_at(w, at)) {
        const plow::Record& r = hp.recs[q[at]];
        int64_t work;
        if (hp.profile && r.opcode != PLOW_OP_NOP) {
          const auto t0 = std::chrono::steady_clock::now();
          work = plow::run_record(ctx, r, scratch.data());
          const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::chrono::steady_clock::now() - t0).count();
          hp.op_ns[r.op_index].fetch_add(ns, std::memory_order_relaxed);
        } else {
          work = plow::run_record(ctx, r, scratch.data());
        }
        if (work != 0) hp.op_work[r.op_index].fetch_add(work, std::memory_order_relaxed);
        if (r.signal_counter != PLOW_NO_COUNTER) {
          // release (and seq_cst against the sleepers check below: a sleeper either sees
          // this increment or is seen and woken)
          hp.counters[r.signal_counter].v.fetch_add(1, std::memory_order_seq_cst);
          if (hp.sleepers.load(std::memory_order_seq_cst) > 0) {
            std::lock_guard<std::mutex> lk(hp.sleep_mu);
            hp.epoch.fetch_add(1, std::memory_order_relaxed);
            hp.sleep_cv.notify_all();
          }
        }
        if (r.opcode == PLOW_OP_NOP) ++nops; else ++tasks;
        ++at;
        qs.at.store(at, std::memory_order_relaxed);
        ran = true;
        if (at == q.size()) hp.queues_left.fetch_sub(1, std::memory_order_acq_rel);
    }
    qs.busy.store(false, std::memory_order_release);
    return ran;
  };
  while (hp.queues_left.load(std::memory_order_acquire) > 0) {
    bool moved = false;
    for (int w : mine) moved = advance(w) || moved;
    if (!moved)
      for (int w : others) moved = advance(w) || moved;
    if (moved || hp.queues_left.load(std::memory_order_acquire) == 0) {
      spins = 0;
      last = std::chrono::steady_clock::now();
      continue;
    }
    if (hp.abort.load(std::memory_order_relaxed)) break;
    ++spins;
    if (spins < kSpins) {
      PLOW_PAUSE();
      continue;
    }
    if (spins < kSpins + kYields) {
      std::this_thread::yield();
      continue;
    }
    {  // nap until a counter moves (or kNap passes)
      const uint64_t e = hp.epoch.load(std::memory_order_relaxed);
      hp.sleepers.fetch_add(1, std::memory_order_seq_cst);
      bool any = false;
      for (int w = 0; w < nq && !any; ++w) any = ready(w);
      if (!any) {
        std::unique_lock<std::mutex> lk(hp.sleep_mu);
        hp.sleep_cv.wait_for(lk, kNap, [&] {
          return hp.epoch.load(std::memory_order_relaxed) != e ||
                 hp.abort.load(std::memory_order_relaxed);
        });
      }
      hp.sleepers.fetch_sub(1, std::memory_order_seq_cst);
      spins = kSpins;  // yield a little, then nap again
    }
    const auto now = std::chrono::steady_clock::now();
    if (std::chrono::duration_cast<std::chrono::milliseconds>(now - last).count() >
        sa->timeout_ms) {
      std::lock_guard<std::mutex> lk(hp.stuck_mu);
      if (hp.stuck.empty()) {
        for (int w = 0; w < nq; ++w) {
          const auto& q = hp.queues[w];
          const size_t at = hp.qs[w].at.load(std::memory_order_relaxed);
          if (at >= q.size()) continue;
          const plow::Record& r = hp.recs[q[at]];
          char buf[256];
          snprintf(buf, sizeof buf,
                   "worker %d blocked at packet %lld: counter %u is at %llu, waits for %llu",
                   w, static_cast<long long>(q[at]), r.wait_counter,
                   static_cast<unsigned long long>(hp.counters[r.wait_counter].v.load()),
                   static_cast<unsigned long long>(hp.per_step[r.wait_counter] * (s - 1) +
                                                   r.wait_threshold));
          hp.stuck = buf;
          break;
        }
      }
      hp.abort.store(true);
      std::lock_guard<std::mutex> lk2(hp.sleep_mu);
      hp.sleep_cv.notify_all();
      break;
    }
  }
  hp.tasks_run.fetch_add(tasks);
  hp.nops_run.fetch_add(nops);
}

}  // namespace

extern "C" {

void* plow_plan_new(const PlowPlan* plan, char* err, int64_t errlen) {
  if (plan == nullptr || plan->abi != PLOW_ABI_VERSION) {
    set_err(err, errlen, "plan ABI version mismatch (rebuild the native library: make native)");
    return nullptr;
  }
  auto* hp = new (std::nothrow) HostPlan();
  if (hp == nullptr) return nullptr;
  hp->p = *plan;
  hp->ops.assign(plan->ops, plan->ops + plan->n_ops);
  hp->p.ops = hp->ops.data();
  hp->queues.resize(static_cast<size_t>(std::max<int32_t>(plan->n_workers, 1)));
  hp->per_step.assign(static_cast<size_t>(plan->n_counters), 0);
  hp->qs.reset(new HostPlan::Queue[hp->queues.size()]);
  for (const auto& op : hp->ops) {
    if (op.kind == PLOW_ATTENTION) {
      const int64_t keys = op.tile[1] > 0 ? op.tile[1] : op.ext[1];
      hp->scratch_floats = std::max(hp->scratch_floats, plow::attention_scratch_floats(keys, op.d[4]));
    }
  }
  char buf[256];
  auto fail = [&](const char* msg) {
    set_err(err, errlen, msg);
    delete hp;
    return nullptr;
  };
  for (int64_t i = 0; i < plan->n_records; ++i) {
    const plow::Record r = plow::decode_record(plan->records + i * PLOW_RECORD_SIZE);
    if (!supported(r.opcode)) {
      snprintf(buf, sizeof buf, "packet %lld: opcode %u is not supported by this build",
               static_cast<long long>(i), r.opcode);
      return fail(buf);
    }
    if (r.worker >= hp->queues.size()) {
      snprintf(buf, sizeof buf, "packet %lld: worker %u outside the plan's %zu workers",
               static_cast<long long>(i), r.worker, hp->queues.size());
      return fail(buf);
    }
    for (uint32_t c : {r.wait_counter, r.signal_counter}) {
      if (c != PLOW_NO_COUNTER && c >= static_cast<uint64_t>(plan->n_counters)) {
        snprintf(buf, sizeof buf, "packet %lld: counter %u does not exist (%lld counters)",
                 static_cast<long long>(i), c, static_cast<long long>(plan->n_counters));
        return fail(buf);
      }
    }
    if (r.opcode != PLOW_OP_NOP && r.opcode != PLOW_OP_LOAD) {
      if (r.op_index >= static_cast<uint64_t>(plan->n_ops)) {
        snprintf(buf, sizeof buf, "packet %lld: op %u outside the op table",
                 static_cast<long long>(i), r.op_index);
        return fail(buf);
      }
      const PlowOp& op = hp->ops[r.op_index];
      const bool merge = (r.flags & PLOW_FLAG_ACCUMULATE) != 0;
      int64_t units = 1;
      for (int a = 0; a < op.naxes; ++a) units *= op.steps[a];
      if (merge) units = op.n_merge;
      if (op.kind == 0 || static_cast<int64_t>(r.row_start) + r.rows > units) {
        snprintf(buf, sizeof buf, "packet %lld: units %u..%u of op %u (%lld units, kind %d)",
                 static_cast<long long>(i), r.row_start, r.row_start + r.rows, r.op_index,
                 static_cast<long long>(units), op.kind);
        return fail(buf);
      }
      const bool attn_merge = merge && op.kind == PLOW_ATTENTION && r.opcode == PLOW_OP_ATTENTION_MERGE;
      if (static_cast<int32_t>(r.opcode) != op.opcode && !attn_merge) {
        snprintf(buf, sizeof buf, "packet %lld: opcode %u but op %u's opcode is %d",
                 static_cast<long long>(i), r.opcode, r.op_index, op.opcode);
        return fail(buf);
      }
    }
    if (r.signal_counter != PLOW_NO_COUNTER) ++hp->per_step[r.signal_counter];
    hp->queues[r.worker].push_back(i);
    hp->recs.push_back(r);
  }
  hp->op_ns = std::vector<std::atomic<int64_t>>(static_cast<size_t>(plan->n_ops));
  hp->op_work = std::vector<std::atomic<int64_t>>(static_cast<size_t>(plan->n_ops));
  hp->counters = new (std::nothrow) Counter[static_cast<size_t>(std::max<int64_t>(plan->n_counters, 1))];
  if (hp->counters == nullptr) return fail("out of memory for the counters");
  return hp;
}

void plow_plan_free(void* handle) {
  auto* hp = static_cast<HostPlan*>(handle);
  if (hp == nullptr) return;
  delete[] hp->counters;
  delete hp;
}

int32_t plow_plan_dispatch(void* handle, float* arena, int64_t arena_words, int32_t threads,
                           int64_t timeout_ms, char* err, int64_t errlen) {
  auto* hp = static_cast<HostPlan*>(handle);
  (void)arena_words;
  if (threads < 1) threads = 1;
  std::lock_guard<std::mutex> lk(dispatch_mu);
  hp->step += 1;
  hp->abort.store(false);
  {
    int64_t nonempty = 0;
    for (size_t w = 0; w < hp->queues.size(); ++w) {
      hp->qs[w].at.store(0, std::memory_order_relaxed);
      nonempty += hp->queues[w].empty() ? 0 : 1;
    }
    hp->queues_left.store(nonempty);
  }
  hp->tasks_run.store(0);
  hp->nops_run.store(0);
  for (auto& w : hp->op_work) w.store(0, std::memory_order_relaxed);
  hp->stuck.clear();
  StepArgs sa{hp, arena, threads, timeout_ms > 0 ? timeout_ms : 10000};
  pool().run(threads, worker_thread, &sa);
  hp->last_tasks = hp->tasks_run.load();
  hp->last_nops = hp->nops_run.load();
  hp->last_threads = threads;
  if (hp->abort.load()) {
    // counters are left mid-step: bring every one to the end-of-step value so the next
    // dispatch's targets stay right (its bytes are not trusted: the caller raises)
    for (size_t c = 0; c < hp->per_step.size(); ++c)
      hp->counters[c].v.store(hp->per_step[c] * hp->step);
    set_err(err, errlen, "step stuck: " + hp->stuck);
    return -1;
  }
  return 0;
}

int32_t plow_plan_quantum(void* handle, float* arena, int64_t arena_words, int32_t threads,
                          int64_t timeout_ms, int32_t steps, const PlowQuantum* q,
                          const PlowRow* rows, char* err, int64_t errlen) {
  int32_t* out = plow::I32(arena, q->out);
  int32_t* pos = plow::I32(arena, q->positions);
  const int32_t* sidx = plow::I32(arena, q->sample_index);
  int32_t* ring = plow::I32(arena, q->ring);
  int32_t* rem = plow::I32(arena, q->remaining);
  const float* lg = arena + q->logits;
  const int64_t B = q->batch, T = q->tokens, V = q->vocab;
  plow::SampleScratch sc;
  for (int32_t i = 0; i < steps; ++i) {
    const int32_t rc = plow_plan_dispatch(handle, arena, arena_words, threads, timeout_ms, err, errlen);
    if (rc != 0) return rc;
    for (int64_t b = 0; b < B; ++b) {
      const PlowRow& r = rows[b];
      if (!r.active || pos[b * T] < 0 || rem[b] <= 0) {
        ring[i * B + b] = -1;
        if (T == 1) pos[b * T] = -1;
        continue;
      }
      if (!r.greedy)
        out[b] = plow::sample_logits(lg + (b * T + sidx[b]) * V, V, r, r.uniforms[i], sc);
      const int32_t tok = out[b];
      ring[i * B + b] = tok;
      rem[b] -= 1;
      if (T == 1) {
        const int64_t p = pos[b * T] + 1;
        bool stop = rem[b] == 0 || p >= q->context;
        for (int32_t k = 0; k < r.n_stop && !stop; ++k) stop = r.stop[k] == tok;
        pos[b * T] = stop ? -1 : static_cast<int32_t>(p);
      }
    }
  }
  return 0;
}

void plow_plan_last_counts(void* handle, int64_t* out3) {
  auto* hp = static_cast<HostPlan*>(handle);
  out3[0] = hp->last_tasks;
  out3[1] = hp->last_nops;
  out3[2] = hp->last_threads;
}

void plow_plan_profile(void* handle, int32_t enable, int64_t* out_ns) {
  auto* hp = static_cast<HostPlan*>(handle);
  if (out_ns != nullptr)
    for (size_t i = 0; i < hp->op_ns.size(); ++i) out_ns[i] = hp->op_ns[i].exchange(0);
  hp->profile = enable != 0;
}

void plow_plan_work(void* handle, int64_t* out) {
  auto* hp = static_cast<HostPlan*>(handle);
  for (size_t i = 0; i < hp->op_work.size(); ++i) out[i] = hp->op_work[i].load();
}

const char* plow_build_info(void) {
#if defined(__SANITIZE_THREAD__)
  return "plow-native abi 3 tsan portable";
#elif defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return "plow-native abi 3 x86-64-v4 (avx512)";
  if (__builtin_cpu_supports("x86-64-v3")) return "plow-native abi 3 x86-64-v3 (avx2, fma)";
  return "plow-native abi 3 portable";
#else
  return "plow-native abi 3 portable";
#endif
}

}  // extern "C"
