// A late step's grammar work on a thread of its own that never takes the GIL.
//
// Overlapped scheduling launches step N's forward before step N-1's tokens are fed to the
// constrained requests' matchers; step N's masks need those tokens. The engine hands the feed
// and the next masks' fill to this worker (engine/structured/native.py) before it launches the
// forward, and waits for it only when it applies the masks. A Python helper thread could do
// the same work, but it must take the GIL back after each xgrammar call and for its own glue:
// it then waits for the step thread (busy launching the forward in Python) and, when it wins,
// makes the step thread wait for it (measured on the H200 host: the forward's
// launch grew by as much as the read back's wait shrank). This thread calls xgrammar's own
// functions (tvm-ffi function objects, C++) and nothing else, so it runs beside the step
// thread's Python without touching the interpreter.
//
// Written here because no library offers it: xgrammar's batch calls are reached only through
// Python, and tvm-ffi gives function objects, not a worker.
//
// The job, for a worker made by grammar_worker_new:
//   0. with check_rows: token i must be in row check_rows[i] of the bitmask (the mask it was
//      sampled with, still there: the rows are refilled only in 3) and below vocab; if one
//      is not, the job ends here, nothing fed or filled, and the wait's fill ns is -1 (the
//      engine then feeds the matchers one by one, each verdict read)
//   1. accept(matchers, tokens, false)      -- every token is in its matcher's mask (checked
//                                              in 0, or by the engine), so the result is
//                                              not read
//   2. is_terminated(matchers[i]) for i in ask (those fed a stop token): the ended ones
//   3. fill(batch, fill_matchers', bitmask, rows', false) for the fill entries whose fed
//      position (fill_fed, -1: not fed this step) did not end; fill_matchers and fill_fed
//      empty with fill_rows not: the fill entries are the fed matchers, in order (the usual
//      step: two lists fewer to convert on the caller's thread)
// With budget_ns > 0 each row's work is timed (engine/structured/budget.py): 1 feeds the
// matchers one accept_one call each, and 3 fills one fill_one call a row when fill_by_row (else
// xgrammar's batch fill, on its threads, timed as a whole); a row is over the budget when its
// wall time and its least possible CPU time both are (the phase's thread CPU time less the
// other rows' wall time: a row whose thread was preempted did no more work), one clock read a
// row and two a phase (a thread CPU clock read is a system call).
// grammar_worker_wait returns [fill ns, n, the n ended positions..., then pairs (row, CPU ns)
// of the rows over the budget: row i >= 0 the accept of matchers[i], -1-k the fill of entry k]
// or raises the job's error;
// grammar_worker_done says whether the job has ended, without waiting; grammar_worker_wait_done
// is grammar_worker_wait under a name whose Python function object keeps the GIL.
// The caller leaves every matcher of the job alone until the wait returns.

#include <tvm/ffi/any.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <ctime>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace ffi = tvm::ffi;

struct Job {
  ffi::Function accept, fill, is_terminated, accept_one, fill_one;
  int64_t budget_ns = 0;
  bool fill_by_row = false;
  ffi::ObjectRef batch;
  ffi::Array<ffi::ObjectRef> matchers;
  ffi::Array<int64_t> tokens, check_rows;
  int64_t vocab = 0;
  ffi::Array<int64_t> ask;
  ffi::Array<ffi::ObjectRef> fill_matchers;
  ffi::Array<int64_t> fill_rows, fill_fed;
  ffi::Tensor bitmask;
};

class Worker {
 public:
  Worker() : thread_([this] { Loop(); }) {}

  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  void Submit(Job job) {
    std::lock_guard<std::mutex> lock(mu_);
    if (busy_) TVM_FFI_THROW(RuntimeError) << "grammar worker: a job is already running";
    job_ = std::move(job);
    busy_ = true;
    result_.clear();
    error_.clear();
    cv_.notify_all();
  }

  bool Done() {
    std::lock_guard<std::mutex> lock(mu_);
    return !busy_;
  }

  ffi::Array<int64_t> Wait() {
    Job finished;  // released here, on the caller's thread, after the lock (see Loop)
    std::string error;
    std::vector<int64_t> result;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return !busy_; });
      finished = std::move(finished_);
      finished_ = Job();
      error.swap(error_);
      result.swap(result_);
    }
    if (!error.empty()) TVM_FFI_THROW(RuntimeError) << "grammar worker: " << error;
    return ffi::Array<int64_t>(result.begin(), result.end());
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return stop_ || (busy_ && !running_); });
      // a job submitted before the stop still runs: its matchers are then fed or not
      // according to what was asked, never by a race with the free (a worker dropped unclosed)
      if (stop_ && !busy_) return;
      running_ = true;
      Job job = std::move(job_);
      job_ = Job();
      lock.unlock();
      std::vector<int64_t> result;
      std::string error;
      try {
        result = Run(job);
      } catch (const ffi::Error& e) {  // its message, not what() (which adds a backtrace)
        error = std::string(e.kind()) + ": " + std::string(e.message());
      } catch (const std::exception& e) {
        error = e.what();
        if (error.empty()) error = "xgrammar raised";
      } catch (...) {  // anything else would end the process (std::terminate on this thread)
        error = "xgrammar raised a non-standard C++ exception";
      }
      lock.lock();
      // NOTE: the job's references are dropped by Wait, not here: the bitmask came from
      // Python (DLPack), and letting it go takes the GIL -- this thread would then wait for
      // the step thread to give the GIL up, and the job would end only then
      finished_ = std::move(job);
      result_ = std::move(result);
      error_ = std::move(error);
      running_ = false;
      busy_ = false;
      cv_.notify_all();
    }
  }

  static int64_t WallNs() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  static int64_t CpuNs() {  // this thread's CPU time
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
  }

  // Each row's work timed, one call a row: call(i) for i < n; rows over the budget appended
  // to over as (tag(i), least CPU ns). Returns the phase's wall ns.
  template <typename Call, typename Tag>
  static int64_t Timed(size_t n, int64_t budget_ns, Call call, Tag tag,
                       std::vector<int64_t>* over) {
    std::vector<int64_t> wall(n);
    const int64_t c0 = CpuNs(), w0 = WallNs();
    int64_t t = w0;
    for (size_t i = 0; i < n; ++i) {
      call(i);
      const int64_t now = WallNs();
      wall[i] = now - t;
      t = now;
    }
    const int64_t cpu = CpuNs() - c0, phase = t - w0;
    for (size_t i = 0; i < n; ++i) {
      const int64_t least = cpu - (phase - wall[i]);  // the other rows took no more CPU than wall
      if (wall[i] > budget_ns && least > budget_ns) {
        over->push_back(tag(i));
        over->push_back(least);
      }
    }
    return phase;
  }

  static std::vector<int64_t> Run(const Job& job) {
    // out[0]: the fill's ns; out[1]: how many fed positions ended, then those, then over
    std::vector<int64_t> out{0, 0}, over;
    if (!job.check_rows.empty() && !Allowed(job)) return {-1};
    const bool timed = job.budget_ns > 0;
    if (!job.matchers.empty()) {
      if (timed) {
        Timed(job.matchers.size(), job.budget_ns,
              [&](size_t i) { job.accept_one(job.matchers[i], job.tokens[i], false); },
              [](size_t i) { return static_cast<int64_t>(i); }, &over);
      } else {
        job.accept(job.matchers, job.tokens, false);
      }
    }
    std::vector<char> ended(job.matchers.size(), 0);
    for (int64_t i : job.ask) {
      if (job.is_terminated(job.matchers[i]).cast<bool>()) {
        ended[i] = 1;
        out.push_back(i);
        ++out[1];
      }
    }
    ffi::Array<ffi::ObjectRef> live;
    ffi::Array<int64_t> rows;
    std::vector<int64_t> entry;  // the fill entry of each live row
    const bool same = job.fill_matchers.empty();  // the fed matchers (see the top)
    for (size_t k = 0; k < job.fill_rows.size(); ++k) {
      int64_t pos = same ? static_cast<int64_t>(k) : job.fill_fed[k];
      if (pos >= 0 && ended[pos]) continue;
      live.push_back(same ? job.matchers[k] : job.fill_matchers[k]);
      rows.push_back(job.fill_rows[k]);
      entry.push_back(static_cast<int64_t>(k));
    }
    if (!live.empty() && timed && (job.fill_by_row || live.size() == 1)) {
      out[0] = Timed(
          live.size(), job.budget_ns,
          [&](size_t i) { job.fill_one(live[i], job.bitmask, rows[i], false); },
          [&](size_t i) { return -1 - entry[i]; }, &over);
    } else if (!live.empty()) {
      const int64_t t0 = WallNs();
      job.fill(job.batch, live, job.bitmask, rows, false);
      out[0] = WallNs() - t0;
    }
    out.insert(out.end(), over.begin(), over.end());
    return out;
  }

  // whether every token is allowed by its check row (a set bit, below vocab)
  static bool Allowed(const Job& job) {
    const DLTensor* t = job.bitmask.GetDLTensorPtr();
    const int64_t rows = t->shape[0], width = t->shape[1];
    const int32_t* words = reinterpret_cast<const int32_t*>(
        static_cast<const char*>(t->data) + t->byte_offset);
    for (size_t i = 0; i < job.tokens.size(); ++i) {
      const int64_t tok = job.tokens[i], row = job.check_rows[i];
      if (tok < 0 || tok >= job.vocab || (tok >> 5) >= width || row < 0 || row >= rows)
        return false;
      if (!((static_cast<uint32_t>(words[row * width + (tok >> 5)]) >> (tok & 31)) & 1u))
        return false;
    }
    return true;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false, busy_ = false, running_ = false;
  Job job_, finished_;
  std::vector<int64_t> result_;
  std::string error_;
  std::thread thread_;  // last: started once the members above exist
};

Worker* Get(int64_t handle) {
  if (handle == 0) TVM_FFI_THROW(ValueError) << "grammar worker: closed";
  return reinterpret_cast<Worker*>(handle);
}

int64_t WorkerNew() { return reinterpret_cast<int64_t>(new Worker()); }

void WorkerFree(int64_t handle) { delete Get(handle); }

void WorkerSubmit(int64_t handle, ffi::Function accept, ffi::Function fill,
                  ffi::Function is_terminated, ffi::Function accept_one, ffi::Function fill_one,
                  int64_t budget_ns, bool fill_by_row, ffi::ObjectRef batch,
                  ffi::Array<ffi::ObjectRef> matchers, ffi::Array<int64_t> tokens,
                  ffi::Array<int64_t> check_rows, int64_t vocab, ffi::Array<int64_t> ask,
                  ffi::Array<ffi::ObjectRef> fill_matchers, ffi::Array<int64_t> fill_rows,
                  ffi::Array<int64_t> fill_fed, ffi::Tensor bitmask) {
  // fill_matchers and fill_fed empty, fill_rows not: the fed matchers fill (see the top)
  const bool same = fill_matchers.empty() && fill_fed.empty() && !fill_rows.empty();
  if (tokens.size() != matchers.size() ||
      (!check_rows.empty() && check_rows.size() != matchers.size()) ||
      (same ? fill_rows.size() != matchers.size()
            : fill_rows.size() != fill_matchers.size() ||
                  fill_fed.size() != fill_matchers.size())) {
    TVM_FFI_THROW(ValueError) << "grammar worker: lists of unequal lengths";
  }
  const DLTensor* t = bitmask.GetDLTensorPtr();
  if (t->ndim != 2 || t->dtype.code != kDLInt || t->dtype.bits != 32 || t->dtype.lanes != 1 ||
      (t->device.device_type != kDLCPU && t->device.device_type != kDLCUDAHost)) {
    TVM_FFI_THROW(ValueError) << "grammar worker: the bitmask must be a 2-d int32 host tensor";
  }
  // the check reads row r at r * width words (as xgrammar's fill writes it): row-major only
  if (!ffi::IsContiguous(*t))
    TVM_FFI_THROW(ValueError) << "grammar worker: the bitmask must be contiguous";
  for (int64_t i : ask) {
    if (i < 0 || i >= static_cast<int64_t>(matchers.size()))
      TVM_FFI_THROW(IndexError) << "grammar worker: ask position " << i;
  }
  for (int64_t i : fill_fed) {
    if (i < -1 || i >= static_cast<int64_t>(matchers.size()))
      TVM_FFI_THROW(IndexError) << "grammar worker: fed position " << i;
  }
  Get(handle)->Submit(Job{std::move(accept), std::move(fill), std::move(is_terminated),
                          std::move(accept_one), std::move(fill_one), budget_ns, fill_by_row,
                          std::move(batch), std::move(matchers), std::move(tokens),
                          std::move(check_rows), vocab, std::move(ask),
                          std::move(fill_matchers), std::move(fill_rows), std::move(fill_fed),
                          std::move(bitmask)});
}

ffi::Array<int64_t> WorkerWait(int64_t handle) { return Get(handle)->Wait(); }

bool WorkerDone(int64_t handle) { return Get(handle)->Done(); }

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(grammar_worker_new, WorkerNew);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(grammar_worker_free, WorkerFree);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(grammar_worker_submit, WorkerSubmit);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(grammar_worker_wait, WorkerWait);
// the same, for a job known to be done: Python keeps the GIL through this one (native.py)
TVM_FFI_DLL_EXPORT_TYPED_FUNC(grammar_worker_wait_done, WorkerWait);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(grammar_worker_done, WorkerDone);
