#include "dist/device_bootstrap.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>

#include "core/error.h"

namespace lathe::dist {

namespace {

// A non-negative decimal integer (the whole string), else -1.
int64_t parse_count(const char* s) {
  if (!s || !*s) return -1;
  int64_t v = 0;
  for (const char* p = s; *p; ++p) {
    if (*p < '0' || *p > '9') return -1;
    v = v * 10 + (*p - '0');
    if (v > (int64_t{1} << 30)) return -1;
  }
  return v;
}

}  // namespace

std::optional<LocalRank> local_rank_from_env(const std::function<const char*(const char*)>& getenv) {
  struct Pair {
    const char *rank, *size;
  };
  static const Pair kPairs[] = {{"OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
                                {"MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
                                {"SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
                                {"LOCAL_RANK", "LOCAL_WORLD_SIZE"}};
  for (const Pair& p : kPairs) {
    const char* r = getenv(p.rank);
    if (!r) continue;
    const char* s = getenv(p.size);
    const bool slurm = std::strcmp(p.rank, "SLURM_LOCALID") == 0;
    // Slurm writes per-node counts like "2(x3)" for uneven layouts: fall through to host names.
    if (slurm && parse_count(s) < 1) continue;
    const int64_t rank = parse_count(r);
    LATHE_CHECK(rank >= 0,
                "local rank: {}='{}' is not a non-negative integer (set by the launcher; unset it or fix "
                "the launch command)",
                p.rank, r);
    int64_t size = rank + 1;  // without the size variable: at least this many
    if (s) {
      size = parse_count(s);
      LATHE_CHECK(size >= 1, "local rank: {}='{}' is not a positive integer (set by the launcher)", p.size, s);
    }
    LATHE_CHECK(rank < size, "local rank: {}={} is not below {}={} (inconsistent launcher environment)", p.rank, rank,
                p.size, size);
    return LocalRank{static_cast<int>(rank), static_cast<int>(size), p.rank};
  }
  return std::nullopt;
}

std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine) {
  constexpr size_t kMax = 4096;
  LATHE_CHECK(mine.size() <= kMax, "{}: a string of {} bytes to exchange (at most {})", comm.describe(), mine.size(),
              kMax);
  const size_t n = static_cast<size_t>(comm.size());
  // Fixed-size records: [length u64][bytes], so one all_gather of known sizes does it.
  std::vector<char> rec(8 + kMax, 0), all(n * rec.size());
  const uint64_t len = mine.size();
  std::memcpy(rec.data(), &len, 8);
  std::memcpy(rec.data() + 8, mine.data(), mine.size());
  comm.all_gather(rec.data(), all.data(), std::vector<size_t>(n, rec.size()), DType::U8);
  std::vector<std::string> out(n);
  for (size_t i = 0; i < n; ++i) {
    uint64_t l = 0;
    std::memcpy(&l, all.data() + i * rec.size(), 8);
    LATHE_CHECK(l <= kMax, "{}: rank {} sent a string of {} bytes", comm.describe(), i, l);
    out[i].assign(all.data() + i * rec.size() + 8, l);
  }
  return out;
}

LocalRank local_rank_from_hosts(Communicator& comm, const std::string& hostname) {
  const auto hosts = all_gather_strings(comm, hostname);
  LocalRank lr{0, 0, "host names"};
  for (int r = 0; r < comm.size(); ++r) {
    if (hosts[static_cast<size_t>(r)] != hostname) continue;
    if (r < comm.rank()) ++lr.rank;
    ++lr.size;
  }
  return lr;
}

std::string host_name() {
  char buf[256] = {0};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return buf;
}

LocalRank local_rank(Communicator& comm) {
  if (auto lr = local_rank_from_env([](const char* n) { return std::getenv(n); })) return *lr;
  return local_rank_from_hosts(comm, host_name());
}

int device_for_local_rank(const LocalRank& lr, int device_count) {
  LATHE_CHECK(device_count >= 1,
              "no GPU visible to this process (device count {}); check nvidia-smi and "
              "CUDA_VISIBLE_DEVICES, or set device: cpu",
              device_count);
  if (device_count >= lr.size) return lr.rank;
  if (device_count == 1) return 0;  // one GPU bound per rank by the launcher (checked for sharing later)
  throw_error(
      "{} ranks on this node (local rank {} from {}) but {} GPUs visible: lathe runs one rank per GPU (start at "
      "most {} ranks per node, or make more GPUs visible with CUDA_VISIBLE_DEVICES)",
      lr.size, lr.rank, lr.source, device_count, device_count);
}

void check_distinct_devices(Communicator& comm, const std::string& hostname, const std::string& device_uuid) {
  const auto keys = all_gather_strings(comm, hostname + '\n' + device_uuid);
  std::map<std::string, int> first;
  for (int r = 0; r < comm.size(); ++r) {
    auto [it, fresh] = first.emplace(keys[static_cast<size_t>(r)], r);
    if (fresh) continue;
    const std::string& k = keys[static_cast<size_t>(r)];
    const size_t nl = k.find('\n');
    throw_error(
        "{}: ranks {} and {} both use GPU {} on host {}: lathe runs one rank per GPU (start fewer ranks per node, "
        "or give each rank its own GPU through CUDA_VISIBLE_DEVICES)",
        comm.describe(), it->second, r, k.substr(nl + 1), k.substr(0, nl));
  }
}

void bootstrap_group(Communicator& host, size_t id_bytes, const std::function<void(void* id)>& make_id,
                     const std::function<void(const void* id, int rank, int size)>& init) {
  // [status byte][id][error text]: status 1 = id valid, 0 = rank 0 failed and the text says why.
  constexpr size_t kErr = 512;
  std::vector<char> msg(1 + id_bytes + kErr, 0);
  if (host.rank() == 0) {
    try {
      make_id(msg.data() + 1);
      msg[0] = 1;
    } catch (const std::exception& e) {
      std::strncpy(msg.data() + 1 + id_bytes, e.what(), kErr - 1);
    }
  }
  host.broadcast(msg.data(), msg.size(), 0);
  if (!msg[0])
    throw_error("{}: rank 0 of group '{}' could not create the unique id: {}", host.describe(), host.name(),
                std::string(msg.data() + 1 + id_bytes));
  init(msg.data() + 1, host.rank(), host.size());
}

}  // namespace lathe::dist
