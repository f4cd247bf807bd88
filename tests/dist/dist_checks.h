// Checks of the Communicator contract, shared by the thread test (test_comm.cpp) and the MPI test
// (test_comm_mpi.cpp, run under mpirun). Each is called on every rank of `c`. The expected value of
// every reduction is computed here in plain loops, summing the ranks' contributions in rank order
// in the same type: bit equality is required (comm.h promises rank-ordered reductions).
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "dist/comm.h"

namespace testing_checks {
using namespace lathe;
using namespace lathe::dist;

// A value with varied magnitude, so that summation order matters in float.
inline float value(int rank, size_t i) {
  return static_cast<float>(std::sin(0.37 * static_cast<double>(i) + rank) *
                            std::pow(10.0, static_cast<int>((i + static_cast<size_t>(rank)) % 7) - 3));
}

inline void all_reduce(Communicator& c) {
  const int n = c.size();
  for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}, size_t{4097}}) {
    std::vector<float> x(count), want(count);
    for (size_t i = 0; i < count; ++i) {
      x[i] = value(c.rank(), i);
      want[i] = value(0, i);
      for (int r = 1; r < n; ++r) want[i] += value(r, i);
    }
    c.all_reduce(x.data(), count, DType::F32);
    EXPECT_EQ(0, count ? std::memcmp(x.data(), want.data(), count * 4) : 0) << "sum of " << count << " floats";
    std::vector<float> mx(count), mn(count);
    for (size_t i = 0; i < count; ++i) mx[i] = mn[i] = value(c.rank(), i);
    c.all_reduce(mx.data(), count, DType::F32, ReduceOp::Max);
    c.all_reduce(mn.data(), count, DType::F32, ReduceOp::Min);
    for (size_t i = 0; i < count; ++i) {
      float hi = value(0, i), lo = hi;
      for (int r = 1; r < n; ++r) hi = std::max(hi, value(r, i)), lo = std::min(lo, value(r, i));
      EXPECT_EQ(mx[i], hi);
      EXPECT_EQ(mn[i], lo);
    }
  }
  std::vector<int64_t> k = {c.rank() + 1, int64_t{1} << 40};
  c.all_reduce(k.data(), 2, DType::I64);
  EXPECT_EQ(k[0], int64_t{n} * (n + 1) / 2);
  EXPECT_EQ(k[1], int64_t{n} << 40);
  std::vector<double> d = {1e-17 * c.rank(), 1.0};
  c.all_reduce(d.data(), 2, DType::F64);
  double want = 0;
  for (int r = 0; r < n; ++r) want += 1e-17 * r;
  EXPECT_EQ(d[0], want);
  EXPECT_EQ(d[1], static_cast<double>(n));
}

inline std::vector<size_t> uneven(int n) {
  std::vector<size_t> counts(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) counts[static_cast<size_t>(r)] = static_cast<size_t>((r * 3 + 1) % 4) * 37;
  return counts;  // 37, 0, 111, 74, 37, ...: includes an empty segment from 2 ranks on
}

inline void reduce_scatter(Communicator& c) {
  const auto counts = uneven(c.size());
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  size_t off = 0;
  for (int r = 0; r < c.rank(); ++r) off += counts[static_cast<size_t>(r)];
  std::vector<float> send(total), recv(counts[static_cast<size_t>(c.rank())], -1.0f);
  for (size_t i = 0; i < total; ++i) send[i] = value(c.rank(), i);
  c.reduce_scatter(send.data(), recv.data(), counts, DType::F32);
  for (size_t i = 0; i < recv.size(); ++i) {
    float want = value(0, off + i);
    for (int r = 1; r < c.size(); ++r) want += value(r, off + i);
    EXPECT_EQ(recv[i], want) << "element " << i;
  }
}

// Segments larger than one round's piece (Communicator::kReduceStagingBytes: the host path
// exchanges them in rounds): uneven, one empty, one of a single piece; the output disjoint from
// the input, in place at this rank's segment (ZeRO buckets, all_reduce) and overlapping elsewhere
// (at the input's start, as the sequence-parallel row reduction does, and at its end: writing a
// piece there would overwrite input that a later round still sends). Bit-equal to the rank-order
// sum of every element, and the input outside this rank's output untouched.
inline void reduce_scatter_in_pieces(Communicator& c) {
  const int n = c.size();
  const size_t piece = std::max<size_t>(1, Communicator::kReduceStagingBytes / 2 / 4 / static_cast<size_t>(n));
  std::vector<size_t> counts(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    const size_t pattern[4] = {2 * piece + 5, piece, 0, piece + 1};
    counts[static_cast<size_t>(r)] = pattern[r % 4];
  }
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  size_t off = 0;
  for (int r = 0; r < c.rank(); ++r) off += counts[static_cast<size_t>(r)];
  const size_t mine = counts[static_cast<size_t>(c.rank())];
  // Cheap values of varied magnitude (no sin/pow: a few million of them per rank). Integers below
  // 2^24 times powers of two: exact products, so a compiler that fuses the product into the sum
  // below (FMA contraction) cannot change the expected bits.
  auto v = [](int rank, size_t i) {
    const float scale = i % 3 == 0 ? 0x1p-10f : i % 3 == 1 ? 1.0f : 0x1p10f;
    return static_cast<float>((i * 2654435761u + static_cast<size_t>(rank) * 40503u) % 1000003) * scale;
  };
  std::vector<float> want(mine);
  for (size_t i = 0; i < mine; ++i) {
    want[i] = v(0, off + i);
    for (int r = 1; r < n; ++r) want[i] += v(r, off + i);
  }
  std::vector<float> in(total);
  for (size_t i = 0; i < total; ++i) in[i] = v(c.rank(), i);
  for (int mode = 0; mode < 4; ++mode) {  // 0: disjoint, 1: in place at own segment, 2: at the start, 3: end
    std::vector<float> send = in, recv(mode == 0 ? mine : 0, -1.0f);
    float* out = mode == 0   ? recv.data()
                 : mode == 1 ? send.data() + off
                 : mode == 2 ? send.data()
                             : send.data() + total - mine;
    c.reduce_scatter(send.data(), out, counts, DType::F32);
    EXPECT_EQ(0, mine ? std::memcmp(out, want.data(), mine * 4) : 0) << "mode " << mode << ", " << mine << " elements";
    if (mode == 1) {  // the rest of the input as it was
      EXPECT_EQ(0, std::memcmp(send.data(), in.data(), off * 4)) << "before this rank's segment";
      EXPECT_EQ(0, std::memcmp(send.data() + off + mine, in.data() + off + mine, (total - off - mine) * 4))
          << "after this rank's segment";
    }
  }
  // all_reduce over more elements than one round takes: every element the rank-order sum.
  std::vector<float> all(in), sum(total);
  for (size_t i = 0; i < total; ++i) {
    sum[i] = v(0, i);
    for (int r = 1; r < n; ++r) sum[i] += v(r, i);
  }
  c.all_reduce(all.data(), total, DType::F32);
  EXPECT_EQ(0, std::memcmp(all.data(), sum.data(), total * 4)) << "all_reduce of " << total << " floats";
}

inline void all_gather(Communicator& c) {
  std::vector<size_t> counts(static_cast<size_t>(c.size()));
  for (int r = 0; r < c.size(); ++r) counts[static_cast<size_t>(r)] = static_cast<size_t>((r * 2 + 1) % 3);
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  size_t off = 0;
  for (int r = 0; r < c.rank(); ++r) off += counts[static_cast<size_t>(r)];
  std::vector<int64_t> want;
  for (int r = 0; r < c.size(); ++r)
    for (size_t i = 0; i < counts[static_cast<size_t>(r)]; ++i) want.push_back(r * 100 + static_cast<int64_t>(i));
  std::vector<int64_t> mine(counts[static_cast<size_t>(c.rank())]), out(total, -1);
  for (size_t i = 0; i < mine.size(); ++i) mine[i] = c.rank() * 100 + static_cast<int64_t>(i);
  c.all_gather(mine.data(), out.data(), counts, DType::I64);
  EXPECT_EQ(out, want);
  // In place: this rank's contribution already sits in its segment of the output.
  std::vector<int64_t> inplace(total, -1);
  std::copy(mine.begin(), mine.end(), inplace.begin() + static_cast<ptrdiff_t>(off));
  c.all_gather(inplace.data() + off, inplace.data(), counts, DType::I64);
  EXPECT_EQ(inplace, want);
}

inline void broadcast(Communicator& c) {
  for (int root = 0; root < c.size(); ++root) {
    std::vector<int32_t> b(13, c.rank() == root ? root + 1000 : -1);
    c.broadcast(b.data(), b.size() * 4, root);
    EXPECT_EQ(b, std::vector<int32_t>(13, root + 1000));
  }
}

inline void send_recv(Communicator& c) {
  const int n = c.size();
  if (n < 2) return;
  const int next = (c.rank() + 1) % n, prev = (c.rank() + n - 1) % n;
  int32_t a = c.rank(), b = c.rank() + 10, t = c.rank() + 20;
  auto w1 = c.send_async(&a, 4, next, 5);
  auto w2 = c.send_async(&b, 4, next, 5);
  auto w3 = c.send_async(&t, 4, next, 6);
  int32_t got = -1;
  c.recv(&got, 4, prev, 6);  // the tag-6 message first, although it was sent last
  EXPECT_EQ(got, prev + 20);
  c.recv(&got, 4, prev, 5);
  EXPECT_EQ(got, prev);  // same tag: in send order
  c.recv(&got, 4, prev, 5);
  EXPECT_EQ(got, prev + 10);
  w1->wait(), w2->wait(), w3->wait();
}

// A ring exchange of large messages (4 MiB: beyond MPI's eager limit, where MPI_Send waits for the
// receiver and a ring of plain sends would deadlock), several rounds in order, async then waited.
inline void sendrecv_ring(Communicator& c) {
  const int n = c.size();
  if (n < 2) return;
  const int next = (c.rank() + 1) % n, prev = (c.rank() + n - 1) % n;
  const size_t count = size_t{1} << 20;
  std::vector<int32_t> cur(count), nxt(count, -1);
  for (size_t i = 0; i < count; ++i) cur[i] = static_cast<int32_t>(c.rank() * 7 + static_cast<int>(i % 1000));
  for (int step = 1; step < n; ++step) {
    auto w = c.sendrecv_async(cur.data(), count * 4, next, nxt.data(), count * 4, prev, 9);
    w->wait();
    std::swap(cur, nxt);
    const int src = (c.rank() - step + n) % n;  // whose block this rank holds now
    EXPECT_EQ(cur[0], src * 7);
    EXPECT_EQ(cur[count - 1], src * 7 + static_cast<int>((count - 1) % 1000));
  }
  // small messages; with two ranks dst and src are the same peer
  int32_t got[2] = {-1, -1};
  int32_t two[2] = {c.rank(), c.rank() + 100};
  c.sendrecv(two, 8, next, got, 8, prev, 3);
  EXPECT_EQ(got[0], prev);
  EXPECT_EQ(got[1], prev + 100);
}

inline void split(Communicator& c) {
  const int n = c.size();
  auto g = c.split(c.rank() % 2, -c.rank(), "parity");  // reversed order inside each parity group
  ASSERT_TRUE(g);
  std::vector<int> members;
  for (int r = n - 1; r >= 0; --r)
    if (r % 2 == c.rank() % 2) members.push_back(r);
  EXPECT_EQ(g->size(), static_cast<int>(members.size()));
  EXPECT_EQ(members[static_cast<size_t>(g->rank())], c.rank());
  EXPECT_EQ(g->name(), "parity");
  int64_t v = c.rank();
  g->all_reduce(&v, 1, DType::I64);
  EXPECT_EQ(v, std::accumulate(members.begin(), members.end(), int64_t{0}));
  // A rank with a negative color joins no group; the others still form theirs.
  auto h = c.split(c.rank() == 0 && n > 1 ? -1 : 0, 0, "rest");
  if (c.rank() == 0 && n > 1) {
    EXPECT_FALSE(h);
  } else {
    ASSERT_TRUE(h);
    EXPECT_EQ(h->size(), n > 1 ? n - 1 : 1);
    h->barrier();
  }
}

inline void async_order(Communicator& c) {
  std::vector<std::vector<float>> bufs(3, std::vector<float>(257));
  std::vector<WorkPtr> works;
  for (size_t k = 0; k < bufs.size(); ++k) {
    for (size_t i = 0; i < bufs[k].size(); ++i) bufs[k][i] = value(c.rank(), i + 1000 * k);
    works.push_back(c.all_reduce_async(bufs[k].data(), bufs[k].size(), DType::F32));
  }
  for (size_t k = bufs.size(); k-- > 0;) works[k]->wait();
  for (auto& w : works) EXPECT_TRUE(w->done());
  for (size_t k = 0; k < bufs.size(); ++k)
    for (size_t i = 0; i < bufs[k].size(); ++i) {
      float want = value(0, i + 1000 * k);
      for (int r = 1; r < c.size(); ++r) want += value(r, i + 1000 * k);
      EXPECT_EQ(bufs[k][i], want);
    }
  EXPECT_GE(c.issued(), 3u);
}

// all_to_allv: rank r sends rows(r, j) rows of `width` floats to rank j (zero for some pairs, and
// the last rank of a group of 2+ receives nothing at all). The counts step (exchange_counts) must
// report exactly what each peer sends; the rows must arrive whole, in source-rank order.
inline size_t a2a_rows(int src, int dst, int n) {
  if (n > 1 && dst == n - 1) return 0;                  // a peer that receives zero rows
  return static_cast<size_t>((src * 2 + dst * 3) % 4);  // 0..3, zero for some pairs
}
inline float a2a_value(int src, int dst, size_t i) { return value(src, i) + static_cast<float>(100 * dst); }

inline void all_to_allv(Communicator& c) {
  const int n = c.size(), me = c.rank();
  const size_t width = 5;
  std::vector<size_t> send_counts(static_cast<size_t>(n));
  std::vector<float> send;
  for (int j = 0; j < n; ++j) {
    const size_t cnt = a2a_rows(me, j, n) * width;
    send_counts[static_cast<size_t>(j)] = cnt;
    for (size_t i = 0; i < cnt; ++i) send.push_back(a2a_value(me, j, i));
  }
  const std::vector<size_t> recv_counts = c.exchange_counts(send_counts);
  ASSERT_EQ(recv_counts.size(), static_cast<size_t>(n));
  std::vector<float> want;
  for (int i = 0; i < n; ++i) {
    EXPECT_EQ(recv_counts[static_cast<size_t>(i)], a2a_rows(i, me, n) * width) << "from rank " << i;
    for (size_t k = 0; k < a2a_rows(i, me, n) * width; ++k) want.push_back(a2a_value(i, me, k));
  }
  std::vector<float> recv(std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0}), -1.0f);
  c.all_to_all(send.data(), send_counts, recv.data(), recv_counts, DType::F32);
  EXPECT_EQ(recv, want);
  // The async form, issued twice back to back (issue order), with int64 elements.
  std::vector<int64_t> s64(send.size()), r1(recv.size()), r2(recv.size());
  for (size_t i = 0; i < s64.size(); ++i) s64[i] = static_cast<int64_t>(me) * 1000000 + static_cast<int64_t>(i);
  auto w1 = c.all_to_all_async(s64.data(), send_counts, r1.data(), recv_counts, DType::I64);
  auto w2 = c.all_to_all_async(s64.data(), send_counts, r2.data(), recv_counts, DType::I64);
  w2->wait();
  w1->wait();
  EXPECT_EQ(r1, r2);
  size_t at = 0;
  for (int i = 0; i < n; ++i) {
    size_t off = 0;  // where rank i's block for me starts in its send buffer
    for (int j = 0; j < me; ++j) off += a2a_rows(i, j, n) * width;
    for (size_t k = 0; k < recv_counts[static_cast<size_t>(i)]; ++k)
      EXPECT_EQ(r1[at++], static_cast<int64_t>(i) * 1000000 + static_cast<int64_t>(off + k));
  }
  // Everyone sends nothing: still a valid collective.
  const std::vector<size_t> none(static_cast<size_t>(n), 0);
  EXPECT_EQ(c.exchange_counts(none), none);
  c.all_to_all(nullptr, none, nullptr, none, DType::F32);
  // Wrong number of counts is named.
  EXPECT_THROW(c.all_to_all(send.data(), std::vector<size_t>(static_cast<size_t>(n) + 1, 0), recv.data(), recv_counts,
                            DType::F32),
               lathe::Error);
}

}  // namespace testing_checks
