// Progress and ETA for long commands (tokenize, train, convert/export, eval; issue 13 item 5).
//
// On a terminal (stderr is a tty) one line is redrawn in place (at most every 0.2 s):
//   eval tasks [########............]  40.0%  4/10 items  2.1 items/s  ETA 0:03
// Off a terminal (logs, pipes, CI) the same text is printed as plain lines, one each time the work
// crosses another 10% or `plain_interval` seconds passed, whichever comes first, and always at the
// end, so a log shows the run advancing without carriage returns.
//
//   progress::Bar bar("eval tasks", items.size(), "items", !no_progress);
//   for (...) { ...; bar.add(1); }
//   bar.finish();
//
// Line is the lower layer for commands that format their own text (tokenize, tokenizer training).
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>

namespace lathe::progress {

// "4:05", "1:02:03"; "?" for a negative, NaN or absurd (> 3 years) value.
std::string format_duration(double seconds);
// "987", "12.3K", "4.56M", "7.89G" (counts and rates).
std::string format_count(double v);
// Remaining seconds at the mean rate so far: elapsed * (total - done) / done; -1 when unknown
// (nothing done yet, total unknown) so format_duration prints "?".
double eta_seconds(double done, double total, double elapsed);
// "[#####...............]": `width` cells, floor(frac * width) of them filled; frac clamped to [0, 1].
std::string bar_cells(double frac, int width = 20);
// The full line Bar shows: label, bar and percent (when total > 0), done/total unit, rate, ETA.
std::string format_line(const std::string& label, int64_t done, int64_t total, const std::string& unit, double elapsed);

// Whether stderr is a terminal; LATHE_PROGRESS=tty|plain overrides (tests, log collectors that
// render \r). Read once per Line.
bool stderr_is_tty();

// A one-line display on stderr: in place on a terminal, plain periodic lines otherwise.
class Line {
 public:
  explicit Line(bool enabled, double plain_interval = 10.0);
  // Whether to draw now: always when `force`; on a tty every 0.2 s; off a tty when `frac` (the
  // fraction done, or < 0 when unknown) crossed the next 10% step or plain_interval seconds passed.
  bool due(bool force = false, double frac = -1);
  void show(const std::string& line);
  void finish();  // ends the in-place line with '\n' if something was drawn
  bool tty() const { return tty_; }
  bool enabled() const { return enabled_; }

 private:
  bool enabled_, tty_, drawn_ = false;
  double interval_, last_ = -1e30;
  int next_tenth_ = 1;  // off a tty: the next 10% step that prints
  size_t last_len_ = 0;
};

// Counts work items toward a known total (0 = unknown) and shows format_line through a Line.
class Bar {
 public:
  Bar(std::string label, int64_t total, std::string unit, bool enabled, double plain_interval = 10.0);
  void add(int64_t n = 1) { update(done_ + n); }
  void update(int64_t done);
  void finish();              // the final line (100% when done == total), then a newline on a tty
  ~Bar() { line_.finish(); }  // on an exception: end the in-place line, no final line
  Bar(const Bar&) = delete;
  Bar& operator=(const Bar&) = delete;

 private:
  std::string label_, unit_;
  int64_t total_, done_ = 0;
  double t0_;
  bool finished_ = false;
  Line line_;
};

}  // namespace lathe::progress
