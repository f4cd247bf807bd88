// Replays saved fuzz inputs through a libFuzzer target without libFuzzer, so that the ordinary
// Release and ASan/UBSan builds (g++) run every seed and every past crash as a CTest test:
//   fuzz_replay_<target> DIR_OR_FILE...
// Each file is passed to LLVMFuzzerTestOneInput once; a crash, a sanitizer report or an uncaught
// exception fails the test (the target itself catches the lathe::Error its parser throws).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  std::vector<fs::path> files;
  for (int i = 1; i < argc; ++i) {
    fs::path p(argv[i]);
    if (fs::is_directory(p)) {
      for (auto& e : fs::recursive_directory_iterator(p))
        if (e.is_regular_file()) files.push_back(e.path());
    } else if (fs::is_regular_file(p)) {
      files.push_back(p);
    } else {
      std::fprintf(stderr, "fuzz replay: %s: not a file or directory\n", argv[i]);
      return 2;
    }
  }
  if (files.empty()) {
    std::fprintf(stderr, "fuzz replay: no inputs found in the given paths (a target needs a seed corpus)\n");
    return 2;
  }
  std::sort(files.begin(), files.end());
  auto t0 = std::chrono::steady_clock::now();
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("fuzz replay: %zu inputs, %.2f s, no crash\n", files.size(), s);
  return 0;
}
