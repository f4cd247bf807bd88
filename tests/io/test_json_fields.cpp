// io::JsonFields, the one typed reader of untrusted JSON fields: each type read, absent and null
// members, wrong types, integers beyond int64 or outside bounds, non-finite and bounded numbers,
// each in the three wordings (Expected: config.json and recipes; MustBe: tokenizer.json; Field:
// state.json), with the whole message, since those messages are what the formats' tests check.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "error_of.h"
#include "io/json_fields.h"

using namespace lathe;
using lathe::test::error_of;
using io::JsonFields;
using json = nlohmann::json;

namespace {

JsonFields make(JsonFields::Style style, JsonFields::Describe describe = nullptr) {
  return JsonFields(
      style, [](const std::string& field, const std::string& what) { throw_error("F: <{}> {}", field, what); },
      describe);
}

const JsonFields expected = make(JsonFields::Style::Expected);
const JsonFields must_be = make(JsonFields::Style::MustBe);
const JsonFields field = make(JsonFields::Style::Field);

const json big = json::parse("18446744073709551615");  // 2^64 - 1: beyond int64

}  // namespace

TEST(JsonFields, ReadsEachType) {
  for (const JsonFields* f : {&expected, &must_be, &field}) {
    EXPECT_EQ(f->integer(json(-7), "k"), -7);
    EXPECT_EQ(f->integer(json::parse("9223372036854775807"), "k"), INT64_MAX);
    EXPECT_EQ(f->integer(json(5), "k", 5, 5), 5);
    EXPECT_EQ(f->uint64(big, "k"), UINT64_MAX);
    EXPECT_EQ(f->number(json(2.5), "k"), 2.5);
    EXPECT_EQ(f->number(json(3), "k"), 3.0);  // an integer is a number
    EXPECT_EQ(f->number(json(0.0), "k", 0.0), 0.0);
    EXPECT_TRUE(f->boolean(json(true), "k"));
    EXPECT_EQ(f->string(json("s"), "k"), "s");
    EXPECT_TRUE(f->object(json::object(), "k").is_object());
    EXPECT_TRUE(f->array(json::array(), "k").is_array());
  }
}

TEST(JsonFields, FindTreatsNullAsAbsent) {
  const json obj = {{"a", 1}, {"n", nullptr}};
  ASSERT_NE(JsonFields::find(obj, "a"), nullptr);
  EXPECT_EQ(*JsonFields::find(obj, "a"), 1);
  EXPECT_EQ(JsonFields::find(obj, "n"), nullptr);
  EXPECT_EQ(JsonFields::find(obj, "x"), nullptr);
  EXPECT_EQ(JsonFields::find(json::array(), "a"), nullptr);  // not an object
}

TEST(JsonFields, MissingMembers) {
  const json obj = {{"a", 1}, {"n", nullptr}};
  EXPECT_EQ(field.at(obj, "a", "p.a"), 1);
  EXPECT_TRUE(field.at(obj, "n", "p.n").is_null());  // state.json: null is a value
  EXPECT_EQ(error_of([&] { field.at(obj, "x", "p.x"); }), "F: <p.x> is missing");
  // tokenizer.json: null is absent, and the message says what was wanted.
  EXPECT_EQ(error_of([&] { must_be.at(obj, "n", "p.n", "a string"); }), "F: <p.n> is missing (it must be a string)");
  EXPECT_EQ(error_of([&] { must_be.at(obj, "x", "p.x", "a list"); }), "F: <p.x> is missing (it must be a list)");
}

TEST(JsonFields, WrongTypeInEachWording) {
  EXPECT_EQ(error_of([] { expected.integer(json(1.5), "k"); }), "F: <k> expected an integer, got '1.5'");
  EXPECT_EQ(error_of([] { expected.number(json("x"), "k"); }), "F: <k> expected a number, got '\"x\"'");
  EXPECT_EQ(error_of([] { expected.boolean(json(1), "k"); }), "F: <k> expected true or false, got '1'");
  EXPECT_EQ(error_of([] { expected.string(json::array({1, 2}), "k"); }), "F: <k> expected a string, got '[1,2]'");

  EXPECT_EQ(error_of([] { must_be.string(json(3), "k"); }), "F: <k> must be a string, got an integer: 3");
  EXPECT_EQ(error_of([] { must_be.string(json(nullptr), "k"); }), "F: <k> must be a string, got null");
  EXPECT_EQ(error_of([] { must_be.boolean(json("y"), "k"); }),
            "F: <k> must be a boolean (true or false), got a string: \"y\"");
  EXPECT_EQ(error_of([] { must_be.array(json::object(), "k"); }), "F: <k> must be a list, got an object: {}");
  EXPECT_EQ(error_of([] { must_be.integer(json("1"), "k", 0, 9); }),
            "F: <k> must be an integer in [0, 9], got a string: \"1\"");

  EXPECT_EQ(error_of([] { field.integer(json(nullptr), "k"); }), "F: <k> must be an integer, got null null");
  EXPECT_EQ(error_of([] { field.array(json(true), "k"); }), "F: <k> must be an array, got a boolean true");
  EXPECT_EQ(error_of([] { field.object(json::array(), "k"); }), "F: <k> must be an object, got an array []");
  EXPECT_EQ(error_of([] { field.uint64(json(-1), "k"); }),
            "F: <k> must be an unsigned 64-bit integer, got an integer -1");
  EXPECT_EQ(error_of([] { field.number(json("1"), "k"); }), "F: <k> must be a number, got a string \"1\"");
}

TEST(JsonFields, ExpectedQuotesValuesWithTheFormatsDescribe) {
  const JsonFields f = make(JsonFields::Style::Expected, [](const json& v) { return std::string(v.type_name()); });
  EXPECT_EQ(error_of([&] { f.integer(json::object(), "k"); }), "F: <k> expected an integer, got 'object'");
  EXPECT_EQ(error_of([&] { f.integer(big, "k"); }), "F: <k> number does not fit a 64-bit integer");
}

TEST(JsonFields, IntegersOutOfRange) {
  // Beyond int64: never wrapped.
  EXPECT_EQ(error_of([] { expected.integer(big, "k"); }), "F: <k> 18446744073709551615 does not fit a 64-bit integer");
  EXPECT_EQ(error_of([] { must_be.integer(big, "k", 0, 10); }),
            "F: <k> must be an integer in [0, 10], got an integer: 18446744073709551615");
  EXPECT_EQ(error_of([] { field.integer(big, "k"); }),
            "F: <k> is 18446744073709551615, above the largest allowed 9223372036854775807");
  // Outside [lo, hi], above (parsed as unsigned, and built as signed) and below.
  EXPECT_EQ(error_of([] { expected.integer(json::parse("3000000000"), "k", INT32_MIN, INT32_MAX); }),
            "F: <k> 3000000000 is out of range");
  EXPECT_EQ(error_of([] { expected.integer(json(int64_t{3000000000}), "k", INT32_MIN, INT32_MAX); }),
            "F: <k> 3000000000 is out of range");
  EXPECT_EQ(error_of([] { expected.integer(json(-3000000000LL), "k", INT32_MIN, INT32_MAX); }),
            "F: <k> -3000000000 is out of range");
  EXPECT_EQ(error_of([] { must_be.integer(json(-1), "k", 0, 10); }),
            "F: <k> must be an integer in [0, 10], got an integer: -1");
  EXPECT_EQ(error_of([] { must_be.integer(json::parse("11"), "k", 0, 10); }),
            "F: <k> must be an integer in [0, 10], got an integer: 11");
  EXPECT_EQ(error_of([] { field.integer(json::parse("11"), "k", 0, 10); }),
            "F: <k> is 11, above the largest allowed 10");
  EXPECT_EQ(error_of([] { field.integer(json(int64_t{11}), "k", 0, 10); }), "F: <k> is 11, outside [0, 10]");
  EXPECT_EQ(error_of([] { field.integer(json(-1), "k", 0, 10); }), "F: <k> is -1, outside [0, 10]");
}

TEST(JsonFields, NumbersMustBeFiniteAndInBounds) {
  const json inf = json(std::numeric_limits<double>::infinity());
  EXPECT_EQ(error_of([&] { expected.number(inf, "k"); }), "F: <k> inf is not a finite number");
  EXPECT_EQ(error_of([&] { must_be.number(json(-std::numeric_limits<double>::infinity()), "k"); }), "F: <k> -inf is not a finite number");
  EXPECT_EQ(error_of([] { expected.number(json(-1.5), "k", 0.0); }), "F: <k> -1.5 must be >= 0");
  EXPECT_EQ(error_of([&] { field.number(inf, "k", 0.0); }), "F: <k> is inf, must be finite and >= 0");
  EXPECT_EQ(error_of([] { field.number(json(-0.5), "k", 0.0); }), "F: <k> is -0.5, must be finite and >= 0");
  EXPECT_EQ(error_of([] { field.number(json(0.0), "k", 0.0, true); }), "F: <k> is 0, must be finite and > 0");
}

TEST(JsonFields, ASinkThatReturnsStillEndsInAnError) {
  const JsonFields f(JsonFields::Style::Field, [](const std::string&, const std::string&) {});
  EXPECT_EQ(error_of([&] { f.string(json(1), "k"); }), "k: must be a string, got an integer 1");
}
