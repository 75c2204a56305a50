// Engram rows as an XLA FFI handler: the per-step host work of a V4.1 decode step without Python.
//
// Why: decode's one host call per step (hash the newest n-grams, gather their table rows) was a Python
// io_callback, and on the H200 it left the device idle 0.7-1.4 ms of each V4.1 token (experiments/README.md,
// twelfth session): a callback crosses into Python with the GIL and numpy on the critical path of every step.
// Here the same work is C++ called by XLA in the step itself: copy the few token ids to the host, hash them
// (MODEL.md section 3), gather each row from a table in memory or read it from the GGUF with O_DIRECT behind a
// direct-mapped cache, and copy the rows back. jds41/layers/engram_rows.py is the reference this must equal
// (tests/test_engram_ffi.py); jds41/native/engram_ffi.py builds, loads and calls it.
//
// CUDA is reached through the driver library (libcuda.so.1, loaded when the first GPU call comes), so the file
// builds on a machine with no CUDA toolkit and the same library serves the CPU and the GPU platforms.

#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kAlign = 4096;  // O_DIRECT offsets, lengths and buffers are multiples of this
constexpr int kKeyRowBits = 40;   // a cache key is (table slot << 40) | row, as in tiers/engram_store.py

// A fixed pool of reader threads: single 4 KiB O_DIRECT reads are latency-bound, so the number in flight is
// what sets their rate (the Python SsdRowSource keeps 32 in flight for the same reason).
class ReaderPool {
 public:
  explicit ReaderPool(int n) {
    for (int i = 0; i < n; ++i) workers_.emplace_back([this] { Loop(); });
  }
  ~ReaderPool() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
  }
  // Runs every job (each may fail with a message) and returns the first failure, or "" when all succeeded.
  std::string RunAll(std::vector<std::function<std::string()>>& jobs) {
    std::mutex done_mu;
    std::condition_variable done_cv;
    size_t left = jobs.size();
    std::string first_error;
    {
      std::lock_guard<std::mutex> g(mu_);
      for (auto& job : jobs) {
        queue_.push_back([&, job] {
          std::string err = job();
          std::lock_guard<std::mutex> d(done_mu);
          if (!err.empty() && first_error.empty()) first_error = err;
          if (--left == 0) done_cv.notify_one();
        });
      }
    }
    cv_.notify_all();
    std::unique_lock<std::mutex> d(done_mu);
    done_cv.wait(d, [&] { return left == 0; });
    return first_error;
  }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [this] { return stop_ || !queue_.empty(); });
        if (stop_ && queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }
  std::vector<std::thread> workers_;
  std::deque<std::function<void()>> queue_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
};

struct Table {
  const uint8_t* data = nullptr;  // a table in memory (mmap or a host copy), or
  std::string path;               // a table read from this file at `offset`, `rows` rows
  int fd = -1;
  int64_t offset = 0;
  int64_t rows = 0;
};

struct Context {
  int n_layers, n_buckets, max_ngram, n_heads, row_bytes;
  std::vector<uint64_t> token_map, mult, primes;  // mult [L, n], primes [L, NB]
  std::vector<int64_t> offsets;                   // [L, NB]
  uint64_t pad_cid = 0;
  std::vector<Table> tables;
  // Rows read from files pass through a direct-mapped cache (one place per key, like SsdRowSource's).
  std::vector<int64_t> cache_keys;
  std::vector<uint8_t> cache_data;
  std::mutex cache_mu;
  std::unique_ptr<ReaderPool> pool;
  std::atomic<int64_t> rows_requested{0}, rows_read{0}, cache_hits{0}, calls{0};
  // The token feed: every call's token ids, for a Python thread that starts the SSD reads of their hash-layer
  // experts (TierRuntime.prefetch_tokens) beside the step instead of inside it.
  bool feed_on = false, feed_closed = false;
  std::deque<int32_t> feed;
  std::mutex feed_mu;
  std::condition_variable feed_cv;
  ~Context() {
    for (auto& t : tables)
      if (t.fd >= 0) close(t.fd);
  }
};

std::mutex g_contexts_mu;
std::map<int64_t, std::shared_ptr<Context>> g_contexts;
int64_t g_next_id = 1;
thread_local std::string g_last_error;

std::shared_ptr<Context> Find(int64_t id) {
  std::lock_guard<std::mutex> g(g_contexts_mu);
  auto it = g_contexts.find(id);
  return it == g_contexts.end() ? nullptr : it->second;
}

int64_t CacheIndex(int64_t key, size_t size) {
  uint64_t mixed = static_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ull;
  return static_cast<int64_t>((mixed >> 24) % size);
}

// The row ids of T new tokens preceded by `hist` (the real history, oldest first): [T, L, NB], exactly as
// EngramHasher.row_ids_seq computes them. A negative id blocks its slot and every older one (map(pad_id)).
std::string HashRows(const Context& c, const int32_t* hist, int n_hist, const int32_t* tokens, int T,
                     std::vector<int64_t>& rows) {
  const int n = c.max_ngram, L = c.n_layers, NB = c.n_buckets, H = c.n_heads;
  std::vector<int64_t> seq(hist, hist + n_hist);
  seq.insert(seq.end(), tokens, tokens + T);
  for (int64_t id : seq)
    if (id >= static_cast<int64_t>(c.token_map.size()))
      return "token id " + std::to_string(id) + " outside the token map (" + std::to_string(c.token_map.size()) +
             " entries)";
  rows.assign(static_cast<size_t>(T) * L * NB, 0);
  std::vector<uint64_t> ctx(n);
  for (int t = 0; t < T; ++t) {
    const int p = n_hist + t;
    bool live = true;
    for (int k = 0; k < n; ++k) {
      live = live && p - k >= 0 && seq[p - k] >= 0;
      ctx[k] = live ? c.token_map[seq[p - k]] : c.pad_cid;
    }
    for (int l = 0; l < L; ++l) {
      const uint64_t* m = &c.mult[static_cast<size_t>(l) * n];
      uint64_t h = ctx[0] * m[0];  // products wrap mod 2^64, as numpy's uint64 does
      for (int order = 2; order <= n; ++order) {
        h ^= ctx[order - 1] * m[order - 1];
        for (int head = 0; head < H; ++head) {
          const int b = (order - 2) * H + head;
          const size_t at = static_cast<size_t>(l) * NB + b;
          rows[(static_cast<size_t>(t) * L + l) * NB + b] =
              static_cast<int64_t>(h % c.primes[at]) + c.offsets[at];
        }
      }
    }
  }
  return "";
}

// One row of a file table, read with the aligned span that holds it, into `dst`.
std::string ReadFileRow(const Context& c, int slot, int64_t row, uint8_t* dst) {
  const Table& t = c.tables[slot];
  const int64_t start = t.offset + row * c.row_bytes;
  const int64_t lo = start - start % kAlign;
  const int64_t hi = (start + c.row_bytes + kAlign - 1) / kAlign * kAlign;
  void* buf = nullptr;
  if (posix_memalign(&buf, kAlign, hi - lo) != 0) return "out of memory for an Engram read";
  int64_t got = 0;
  while (got < hi - lo) {
    ssize_t r = pread(t.fd, static_cast<uint8_t*>(buf) + got, hi - lo - got, lo + got);
    if (r < 0) {
      free(buf);
      return t.path + ": Engram table " + std::to_string(slot) + " row " + std::to_string(row) +
             ": read failed: " + std::strerror(errno);
    }
    if (r == 0) break;  // end of file: only an error if the row itself was cut
    got += r;
  }
  if (got < start - lo + c.row_bytes) {
    free(buf);
    return t.path + ": Engram table " + std::to_string(slot) + " row " + std::to_string(row) +
           ": file ends inside the row";
  }
  std::memcpy(dst, static_cast<uint8_t*>(buf) + (start - lo), c.row_bytes);
  free(buf);
  return "";
}

// Gathers the rows of `ids` [T, L, NB] into `out` [T, L, NB, row_bytes]. Rows of file tables come from the
// cache or are read (each distinct missing row once, on the pool).
std::string GatherRows(Context& c, const std::vector<int64_t>& ids, uint8_t* out) {
  const int L = c.n_layers, NB = c.n_buckets, RB = c.row_bytes;
  c.rows_requested += static_cast<int64_t>(ids.size());
  std::map<int64_t, std::vector<size_t>> missing;  // key -> places in `ids`
  for (size_t i = 0; i < ids.size(); ++i) {
    const int slot = static_cast<int>((i / NB) % L);
    const Table& t = c.tables[slot];
    const int64_t row = ids[i];
    if (row < 0 || row >= t.rows)
      return "Engram layer slot " + std::to_string(slot) + ": row " + std::to_string(row) + " outside [0, " +
             std::to_string(t.rows) + ")";
    if (t.data != nullptr) {
      std::memcpy(out + i * RB, t.data + row * RB, RB);
      continue;
    }
    const int64_t key = (static_cast<int64_t>(slot) << kKeyRowBits) | row;
    missing[key].push_back(i);
  }
  if (missing.empty()) return "";
  std::vector<std::pair<int64_t, std::vector<size_t>>> todo;
  {
    std::lock_guard<std::mutex> g(c.cache_mu);
    for (auto& [key, places] : missing) {
      const int64_t at = CacheIndex(key, c.cache_keys.size());
      if (c.cache_keys[at] == key) {
        for (size_t i : places) std::memcpy(out + i * RB, &c.cache_data[static_cast<size_t>(at) * RB], RB);
        c.cache_hits += 1;
      } else {
        todo.emplace_back(key, std::move(places));
      }
    }
  }
  if (todo.empty()) return "";
  std::vector<std::function<std::string()>> jobs;
  for (auto& [key, places] : todo) {
    const int slot = static_cast<int>(key >> kKeyRowBits);
    const int64_t row = key & ((int64_t{1} << kKeyRowBits) - 1);
    uint8_t* first = out + places[0] * RB;
    jobs.emplace_back([&c, slot, row, first] { return ReadFileRow(c, slot, row, first); });
  }
  std::string err = c.pool->RunAll(jobs);
  if (!err.empty()) return err;
  c.rows_read += static_cast<int64_t>(todo.size());
  std::lock_guard<std::mutex> g(c.cache_mu);
  for (auto& [key, places] : todo) {
    const uint8_t* src = out + places[0] * RB;
    for (size_t j = 1; j < places.size(); ++j) std::memcpy(out + places[j] * RB, src, RB);
    const int64_t at = CacheIndex(key, c.cache_keys.size());
    c.cache_keys[at] = key;
    std::memcpy(&c.cache_data[static_cast<size_t>(at) * RB], src, RB);
  }
  return "";
}

constexpr size_t kFeedMax = 4096;  // a feed nobody reads keeps only its newest ids

void Feed(Context& c, const int32_t* tokens, int T) {
  {
    std::lock_guard<std::mutex> g(c.feed_mu);
    for (int t = 0; t < T; ++t)
      if (tokens[t] >= 0) c.feed.push_back(tokens[t]);
    while (c.feed.size() > kFeedMax) c.feed.pop_front();
  }
  c.feed_cv.notify_one();
}

// Hash and gather, host buffers in and out: shared by both platforms.
std::string RowsOnHost(int64_t ctx_id, const int32_t* tokens, int T, const int32_t* hist, int hist_len,
                       int32_t n_hist, uint8_t* out, size_t out_bytes) {
  std::shared_ptr<Context> c = Find(ctx_id);
  if (!c) return "Engram FFI context " + std::to_string(ctx_id) + " is not registered (engine closed?)";
  c->calls += 1;
  if (c->feed_on) Feed(*c, tokens, T);
  const size_t want = static_cast<size_t>(T) * c->n_layers * c->n_buckets * c->row_bytes;
  if (out_bytes != want)
    return "Engram FFI output holds " + std::to_string(out_bytes) + " bytes, the rows need " + std::to_string(want);
  n_hist = std::max(0, std::min(n_hist, hist_len));
  std::vector<int64_t> ids;
  std::string err = HashRows(*c, hist + (hist_len - n_hist), n_hist, tokens, T, ids);
  if (!err.empty()) return err;
  return GatherRows(*c, ids, out);
}

// ---- the CUDA driver calls the GPU handler needs, bound at its first call -------------------------------------
using CUresult = int;
using CUstream = void*;
using CUcontext = void*;
struct CudaDriver {
  CUresult (*memcpy_dtoh)(void*, uint64_t, size_t, CUstream) = nullptr;
  CUresult (*memcpy_htod)(uint64_t, const void*, size_t, CUstream) = nullptr;
  CUresult (*stream_sync)(CUstream) = nullptr;
  CUresult (*stream_ctx)(CUstream, CUcontext*) = nullptr;
  CUresult (*ctx_push)(CUcontext) = nullptr;
  CUresult (*ctx_pop)(CUcontext*) = nullptr;
  std::string error;
};

const CudaDriver& Driver() {
  static CudaDriver d = [] {
    CudaDriver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      d.error = std::string("libcuda.so.1 not found: ") + dlerror();
      return d;
    }
    d.memcpy_dtoh = reinterpret_cast<decltype(d.memcpy_dtoh)>(dlsym(lib, "cuMemcpyDtoHAsync_v2"));
    d.memcpy_htod = reinterpret_cast<decltype(d.memcpy_htod)>(dlsym(lib, "cuMemcpyHtoDAsync_v2"));
    d.stream_sync = reinterpret_cast<decltype(d.stream_sync)>(dlsym(lib, "cuStreamSynchronize"));
    d.stream_ctx = reinterpret_cast<decltype(d.stream_ctx)>(dlsym(lib, "cuStreamGetCtx"));
    d.ctx_push = reinterpret_cast<decltype(d.ctx_push)>(dlsym(lib, "cuCtxPushCurrent_v2"));
    d.ctx_pop = reinterpret_cast<decltype(d.ctx_pop)>(dlsym(lib, "cuCtxPopCurrent_v2"));
    if (!d.memcpy_dtoh || !d.memcpy_htod || !d.stream_sync || !d.stream_ctx || !d.ctx_push || !d.ctx_pop)
      d.error = "libcuda.so.1 lacks a driver call the Engram handler needs";
    return d;
  }();
  return d;
}

ffi::Error CpuRows(ffi::Buffer<ffi::S32> tokens, ffi::Buffer<ffi::S32> hist, ffi::Buffer<ffi::S32> n_hist,
                   ffi::ResultBuffer<ffi::U8> out, int64_t ctx) {
  std::string err = RowsOnHost(ctx, tokens.typed_data(), static_cast<int>(tokens.element_count()),
                               hist.typed_data(), static_cast<int>(hist.element_count()), n_hist.typed_data()[0],
                               out->typed_data(), out->size_bytes());
  return err.empty() ? ffi::Error::Success() : ffi::Error::Internal(err);
}

ffi::Error CudaRows(void* stream, ffi::Buffer<ffi::S32> tokens, ffi::Buffer<ffi::S32> hist,
                    ffi::Buffer<ffi::S32> n_hist, ffi::ResultBuffer<ffi::U8> out, int64_t ctx) {
  const CudaDriver& d = Driver();
  if (!d.error.empty()) return ffi::Error::Internal(d.error);
  CUcontext cu_ctx = nullptr;
  if (d.stream_ctx(stream, &cu_ctx) != 0 || d.ctx_push(cu_ctx) != 0)
    return ffi::Error::Internal("cannot make the stream's CUDA context current");
  const int T = static_cast<int>(tokens.element_count()), H = static_cast<int>(hist.element_count());
  std::vector<int32_t> host(T + H + 1);
  std::vector<uint8_t> rows(out->size_bytes());
  std::string err;
  auto dev = [](const void* p) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)); };
  // The ids are the previous step's output: this wait is the one data dependency the step has on the host.
  if (d.memcpy_dtoh(host.data(), dev(tokens.untyped_data()), T * 4, stream) != 0 ||
      (H && d.memcpy_dtoh(host.data() + T, dev(hist.untyped_data()), H * 4, stream) != 0) ||
      d.memcpy_dtoh(host.data() + T + H, dev(n_hist.untyped_data()), 4, stream) != 0 || d.stream_sync(stream) != 0)
    err = "copying the Engram token ids to the host failed";
  if (err.empty())
    err = RowsOnHost(ctx, host.data(), T, host.data() + T, H, host[T + H], rows.data(), rows.size());
  // From pageable memory the copy returns once the bytes are staged, so `rows` may go when it returns.
  if (err.empty() && d.memcpy_htod(dev(out->untyped_data()), rows.data(), rows.size(), stream) != 0)
    err = "copying the Engram rows to the device failed";
  d.ctx_pop(&cu_ctx);
  return err.empty() ? ffi::Error::Success() : ffi::Error::Internal(err);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Jds41EngramRowsCpu, CpuRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Attr<int64_t>("context_id"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(Jds41EngramRowsCuda, CudaRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Attr<int64_t>("context_id"));

// ---- the context API, called from Python through ctypes -------------------------------------------------------
extern "C" {

const char* jds41_engram_last_error() { return g_last_error.c_str(); }

int64_t jds41_engram_new(int n_layers, int n_buckets, int max_ngram, int n_heads, int row_bytes,
                         const uint64_t* token_map, int64_t n_tokens, uint64_t pad_cid, const uint64_t* mult,
                         const uint64_t* primes, const int64_t* offsets) {
  auto c = std::make_shared<Context>();
  c->n_layers = n_layers;
  c->n_buckets = n_buckets;
  c->max_ngram = max_ngram;
  c->n_heads = n_heads;
  c->row_bytes = row_bytes;
  c->token_map.assign(token_map, token_map + n_tokens);
  c->pad_cid = pad_cid;
  c->mult.assign(mult, mult + static_cast<size_t>(n_layers) * max_ngram);
  c->primes.assign(primes, primes + static_cast<size_t>(n_layers) * n_buckets);
  c->offsets.assign(offsets, offsets + static_cast<size_t>(n_layers) * n_buckets);
  c->tables.resize(n_layers);
  std::lock_guard<std::mutex> g(g_contexts_mu);
  const int64_t id = g_next_id++;
  g_contexts[id] = c;
  return id;
}

// A table held in memory for the context's lifetime (the caller keeps the array alive).
int jds41_engram_table_memory(int64_t id, int slot, const uint8_t* data, int64_t rows) {
  std::shared_ptr<Context> c = Find(id);
  if (!c || slot < 0 || slot >= c->n_layers) return -1;
  c->tables[slot].data = data;
  c->tables[slot].rows = rows;
  return 0;
}

// A table read from `path` at byte `offset`; O_DIRECT when `direct` (falling back to buffered reads where the
// file system refuses it, as tiers/ssd.py's DirectFiles does).
int jds41_engram_table_file(int64_t id, int slot, const char* path, int64_t offset, int64_t rows, int direct) {
  std::shared_ptr<Context> c = Find(id);
  if (!c || slot < 0 || slot >= c->n_layers) return -1;
  int fd = direct ? open(path, O_RDONLY | O_DIRECT) : -1;
  if (fd < 0) fd = open(path, O_RDONLY);
  if (fd < 0) {
    g_last_error = std::string(path) + ": " + std::strerror(errno);
    return -1;
  }
  Table& t = c->tables[slot];
  t.path = path;
  t.fd = fd;
  t.offset = offset;
  t.rows = rows;
  return 0;
}

// The row cache and reader pool of file tables (once, before the first call).
void jds41_engram_readers(int64_t id, int64_t cache_rows, int threads) {
  std::shared_ptr<Context> c = Find(id);
  if (!c) return;
  c->cache_keys.assign(std::max<int64_t>(1, cache_rows), -1);
  c->cache_data.assign(static_cast<size_t>(std::max<int64_t>(1, cache_rows)) * c->row_bytes, 0);
  c->pool = std::make_unique<ReaderPool>(std::max(1, threads));
}

// Turns the token feed on (before the first call).
void jds41_engram_feed_on(int64_t id) {
  std::shared_ptr<Context> c = Find(id);
  if (c) c->feed_on = true;
}

// Waits up to `timeout_ms` for fed token ids and moves up to `max` of them to `out`: their count, 0 on timeout,
// -1 once the feed is closed (or the context is gone). Called from Python through ctypes, which drops the GIL.
int jds41_engram_feed_wait(int64_t id, int32_t* out, int max, int timeout_ms) {
  std::shared_ptr<Context> c = Find(id);
  if (!c) return -1;
  std::unique_lock<std::mutex> g(c->feed_mu);
  c->feed_cv.wait_for(g, std::chrono::milliseconds(timeout_ms), [&] { return c->feed_closed || !c->feed.empty(); });
  if (c->feed_closed) return -1;
  int n = 0;
  while (n < max && !c->feed.empty()) {
    out[n++] = c->feed.front();
    c->feed.pop_front();
  }
  return n;
}

void jds41_engram_feed_close(int64_t id) {
  std::shared_ptr<Context> c = Find(id);
  if (!c) return;
  {
    std::lock_guard<std::mutex> g(c->feed_mu);
    c->feed_closed = true;
  }
  c->feed_cv.notify_all();
}

// [calls, rows requested, rows read from files, cache hits]
void jds41_engram_counters(int64_t id, int64_t* out) {
  std::shared_ptr<Context> c = Find(id);
  if (!c) return;
  out[0] = c->calls;
  out[1] = c->rows_requested;
  out[2] = c->rows_read;
  out[3] = c->cache_hits;
}

// Host-side call of the same work, for tests: rows of `T` tokens after `n_hist` history ids.
int jds41_engram_rows_host(int64_t id, const int32_t* tokens, int T, const int32_t* hist, int n_hist, uint8_t* out,
                           int64_t out_bytes) {
  g_last_error = RowsOnHost(id, tokens, T, hist, n_hist, n_hist, out, static_cast<size_t>(out_bytes));
  return g_last_error.empty() ? 0 : -1;
}

// The row ids alone ([T, L, NB] int64), for tests of the hash at full-size parameters (tables too large to hold).
int jds41_engram_row_ids(int64_t id, const int32_t* tokens, int T, const int32_t* hist, int n_hist, int64_t* out) {
  std::shared_ptr<Context> c = Find(id);
  if (!c) return -1;
  std::vector<int64_t> rows;
  g_last_error = HashRows(*c, hist, n_hist, tokens, T, rows);
  if (!g_last_error.empty()) return -1;
  std::memcpy(out, rows.data(), rows.size() * sizeof(int64_t));
  return 0;
}

void jds41_engram_free(int64_t id) {
  std::lock_guard<std::mutex> g(g_contexts_mu);
  g_contexts.erase(id);
}

}  // extern "C"
