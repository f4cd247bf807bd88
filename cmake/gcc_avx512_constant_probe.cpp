// Configure-time probe (CMakeLists.txt): Debian 12's GCC 12.2 with -march=native on AVX-512
// machines, at -O2/-O3, materialises some constant vectors whose first half repeats one value and
// whose second half is zero as a broadcast of that value: std::vector<double>{1, 1, 0, 0} becomes
// {1, 1, 1, 1} (vpbroadcastq from the constant pool). Found through a failing lathe unit test on
// 2026-11-30. Exit 0 when the compiler under the project's flags gets these right.
#include <cstdint>
#include <cstdio>
#include <vector>

// noinline: the values must be materialised in memory, not folded into the comparisons.
template <typename T>
__attribute__((noinline)) int check(const std::vector<T>& v, std::initializer_list<double> want) {
  size_t i = 0;
  for (double w : want)
    if (static_cast<double>(v[i++]) != w) return 1;
  return 0;
}

int main() {
  int bad = 0;
  bad += check(std::vector<double>{1, 1, 0, 0}, {1, 1, 0, 0});
  bad += check(std::vector<float>{1, 1, 1, 1, 0, 0, 0, 0}, {1, 1, 1, 1, 0, 0, 0, 0});
  bad += check(std::vector<uint64_t>{1, 1, 0, 0}, {1, 1, 0, 0});
  bad += check(std::vector<int64_t>{7, 7, 0, 0}, {7, 7, 0, 0});
  if (bad) std::printf("miscompiled %d constant vectors\n", bad);
  return bad ? 1 : 0;
}
