// How many of torch's threads an at::parallel_for in this library runs on (tests/test_20_runtime.py): the
// check that the library was built with -fopenmp, without which the loop runs on the calling thread alone.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <thread>

static int64_t parallel_threads(int64_t n) {
  std::atomic<int64_t> mask{0};
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    mask |= int64_t{1} << (at::get_thread_num() % 63);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));  // long enough that one thread cannot take it all
  });
  return __builtin_popcountll(mask.load());
}

TORCH_LIBRARY_FRAGMENT(roseinfer, m) { m.def("parallel_threads(int n) -> int"); }

TORCH_LIBRARY_IMPL(roseinfer, CompositeExplicitAutograd, m) { m.impl("parallel_threads", &parallel_threads); }
