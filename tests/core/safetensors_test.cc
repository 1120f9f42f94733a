// The safetensors reader: round trips through the writer, memory-mapped files, and a corpus
// of malformed files each answered with INVALID_ARGUMENT naming the problem.
#include "core/safetensors.h"

#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <random>

#include "gtest/gtest.h"

namespace attention::core {
namespace {

// A file image from a literal header and data buffer (header length computed here).
std::string Image(const std::string& header, const std::string& buffer) {
  std::string out(8, '\0');
  const uint64_t length = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  return out + header + buffer;
}

std::string FloatBytes(const std::vector<float>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
}

std::string ValidImage() {
  const std::string a = FloatBytes({1, 2, 3, 4, 5, 6}), b = FloatBytes({-1, 0.5});
  const std::vector<SafetensorsEntry> entries = {{"layer.a", DType::kFloat32, {2, 3}, a},
                                                 {"layer.b", DType::kFloat32, {2}, b}};
  return *SerializeSafetensors(entries, {{"format", "pt"}});
}

class TempDir {
 public:
  TempDir() {
    std::string pattern = ::testing::TempDir() + "safetensors_test.XXXXXX";
    path_ = ::mkdtemp(pattern.data());
  }
  ~TempDir() { std::system(("rm -rf '" + path_ + "'").c_str()); }
  std::string Write(const std::string& name, const std::string& contents) const {
    const std::string path = path_ + "/" + name;
    std::ofstream(path, std::ios::binary) << contents;
    return path;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(SafetensorsTest, RoundTripsFloatTypesAndMetadata) {
  const std::vector<float> values = {0.5f, -2.0f, 3.25f, 0.0f, 1.0f, -0.125f};
  const std::string f32 = FloatBytes(values);
  std::string f16, bf16;
  for (float v : values) {
    const uint16_t h = FloatToHalf(v), b = FloatToBFloat16(v);
    f16.append(reinterpret_cast<const char*>(&h), 2);
    bf16.append(reinterpret_cast<const char*>(&b), 2);
  }
  const std::vector<SafetensorsEntry> entries = {{"f32", DType::kFloat32, {2, 3}, f32},
                                                 {"f16", DType::kFloat16, {6}, f16},
                                                 {"bf16", DType::kBFloat16, {3, 2}, bf16},
                                                 {"empty", DType::kFloat32, {0, 4}, ""}};
  auto image = SerializeSafetensors(entries, {{"config", "{\"a\": 1}"}});
  ASSERT_TRUE(image.ok()) << image.status();
  // The header is padded so that the data buffer starts 8-byte aligned.
  uint64_t header_length = 0;
  std::memcpy(&header_length, image->data(), 8);
  EXPECT_EQ((8 + header_length) % 8, 0u);

  auto file = SafetensorsFile::FromBuffer(*image, "mem.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->metadata().at("config"), "{\"a\": 1}");
  ASSERT_EQ((*file)->tensors().size(), 4u);
  for (const char* name : {"f32", "f16", "bf16"}) {
    const SafetensorsTensor* tensor = (*file)->Find(name);
    ASSERT_NE(tensor, nullptr) << name;
    auto read = (*file)->ReadFloats(*tensor);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(*read, values) << name;  // all values are exact in every format
  }
  EXPECT_EQ((*file)->Find("f32")->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ((*file)->Find("empty")->data.size(), 0u);
  EXPECT_EQ((*file)->Find("missing"), nullptr);
}

TEST(SafetensorsTest, AcceptsUnpaddedHeadersScalarsAndOtherDtypes) {
  // As a hand-written Python exporter would emit: no padding, keys in any order, a scalar,
  // and an integer buffer that the reader keeps but refuses to read as float weights.
  const std::string header =
      R"({"w":{"data_offsets":[0,4],"dtype":"F32","shape":[]},)"
      R"("ids":{"dtype":"I64","shape":[1],"data_offsets":[4,12]}})";
  const std::string image = Image(header, FloatBytes({7.0f}) + std::string(8, '\1'));
  auto file = SafetensorsFile::FromBuffer(image, "py.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(*(*file)->ReadFloats(*(*file)->Find("w")), std::vector<float>{7.0f});
  const absl::Status status = (*file)->ReadFloats(*(*file)->Find("ids")).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(),
            "py.safetensors: tensor \"ids\" has dtype I64; only F32, F16 and BF16 weights are "
            "supported");
}

TEST(SafetensorsTest, OpensMemoryMappedFiles) {
  TempDir dir;
  const std::string path = dir.Write("ok.safetensors", ValidImage());
  auto file = SafetensorsFile::Open(path, {}, "ok.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(*(*file)->ReadFloats(*(*file)->Find("layer.b")), (std::vector<float>{-1, 0.5}));
  EXPECT_EQ((*file)->metadata().at("format"), "pt");

  const absl::Status missing = SafetensorsFile::Open(dir.path() + "/nope.safetensors").status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound) << missing;
  EXPECT_NE(missing.message().find("nope.safetensors"), std::string::npos) << missing;

  const absl::Status directory = SafetensorsFile::Open(dir.path(), {}, "models/").status();
  EXPECT_EQ(directory.code(), absl::StatusCode::kInvalidArgument) << directory;
  EXPECT_EQ(directory.message(), "models/ is not a regular file");

  const absl::Status empty = SafetensorsFile::Open(dir.Write("empty", ""), {}, "empty").status();
  EXPECT_EQ(empty.code(), absl::StatusCode::kInvalidArgument) << empty;
  EXPECT_NE(empty.message().find("empty has 0 bytes"), std::string::npos) << empty;
}

struct MalformedCase {
  std::string name;
  std::string image;
  std::string message_part;
};

std::vector<MalformedCase> MalformedCorpus() {
  const std::string f8 = FloatBytes({1, 2});  // 8 bytes
  const std::string valid = ValidImage();
  std::string huge_length = valid;
  const uint64_t huge = uint64_t{1} << 40;
  std::memcpy(huge_length.data(), &huge, 8);
  std::string past_end_length = valid;
  const uint64_t past = valid.size();
  std::memcpy(past_end_length.data(), &past, 8);
  const std::string deep = "{\"a\":" + std::string(5000, '[') + std::string(5000, ']') + "}";
  auto tensor = [](const std::string& name, const std::string& body) {
    return "\"" + name + "\":{" + body + "}";
  };
  return {
      {"empty file", "", "has 0 bytes; a safetensors file starts with an 8-byte header length"},
      {"truncated length field", std::string(5, '\0'), "has 5 bytes"},
      {"huge header length", huge_length, "header length 1099511627776 exceeds the limit of 100000000 bytes"},
      {"header length past end of file", past_end_length, "runs past the end of the file"},
      {"truncated inside the header", valid.substr(0, 20), "runs past the end of the file (20 bytes)"},
      {"truncated inside the data", valid.substr(0, valid.size() - 3), "past the end of the data buffer"},
      {"bad json", Image("{\"a\": {\"dtype\": ", ""), "header is not valid JSON"},
      {"not an object", Image("[1, 2]", ""), "header does not start with '{'"},
      {"binary garbage header", Image(std::string("{\xff\xfe\x01", 4), ""), "header is not valid JSON"},
      {"deep nesting", Image(deep, ""), "nests deeper than 3 levels"},
      {"unknown dtype", Image("{" + tensor("t", R"("dtype":"F33","shape":[2],"data_offsets":[0,8])") + "}", f8),
       "tensor \"t\" has unknown dtype \"F33\""},
      {"missing dtype", Image("{" + tensor("t", R"("shape":[2],"data_offsets":[0,8])") + "}", f8),
       "tensor \"t\" has no \"dtype\" string"},
      {"tensor not an object", Image(R"({"t": 3})", ""), "tensor \"t\" is not a JSON object"},
      {"shape not an array", Image("{" + tensor("t", R"("dtype":"F32","shape":2,"data_offsets":[0,8])") + "}", f8),
       "tensor \"t\" has no \"shape\" array"},
      {"negative dimension", Image("{" + tensor("t", R"("dtype":"F32","shape":[-2],"data_offsets":[0,8])") + "}", f8),
       "tensor \"t\" shape[0] = -2 is not a non-negative integer"},
      {"fractional dimension", Image("{" + tensor("t", R"("dtype":"F32","shape":[2.5],"data_offsets":[0,8])") + "}", f8),
       "shape[0] = 2.5 is not a non-negative integer"},
      {"three offsets", Image("{" + tensor("t", R"("dtype":"F32","shape":[2],"data_offsets":[0,4,8])") + "}", f8),
       "has no \"data_offsets\" array of two integers"},
      {"begin after end", Image("{" + tensor("t", R"("dtype":"F32","shape":[0],"data_offsets":[8,0])") + "}", f8),
       "data_offsets [8, 0] with begin > end"},
      {"offsets past the end", Image("{" + tensor("t", R"("dtype":"F32","shape":[4],"data_offsets":[0,16])") + "}", f8),
       "tensor \"t\" has data_offsets [0, 16] past the end of the data buffer (8 bytes)"},
      {"byte count does not match shape", Image("{" + tensor("t", R"("dtype":"F32","shape":[3],"data_offsets":[0,8])") + "}", f8),
       "tensor \"t\" has data_offsets [0, 8] (8 bytes) but shape [3] of F32 needs 12 bytes"},
      {"overflowing shape", Image("{" + tensor("t", R"("dtype":"F32","shape":[4611686018427387904,4611686018427387904],"data_offsets":[0,8])") + "}", f8),
       "needs more bytes than the file holds"},
      {"overlapping offsets",
       Image("{" + tensor("a", R"("dtype":"F32","shape":[2],"data_offsets":[0,8])") + "," +
                 tensor("b", R"("dtype":"F32","shape":[2],"data_offsets":[4,12])") + "}",
             f8 + std::string(4, '\0')),
       "tensor \"b\" data_offsets [4, 12] overlap tensor \"a\", which ends at 8"},
      {"duplicate offsets",
       Image("{" + tensor("a", R"("dtype":"F32","shape":[2],"data_offsets":[0,8])") + "," +
                 tensor("b", R"("dtype":"F32","shape":[2],"data_offsets":[0,8])") + "}", f8),
       "overlap tensor \"a\""},
      {"hole between tensors",
       Image("{" + tensor("a", R"("dtype":"F32","shape":[1],"data_offsets":[0,4])") + "," +
                 tensor("b", R"("dtype":"F32","shape":[1],"data_offsets":[8,12])") + "}",
             f8 + std::string(4, '\0')),
       "bytes [4, 8) of the data buffer belong to no tensor (a hole before tensor \"b\")"},
      {"hole at the start", Image("{" + tensor("a", R"("dtype":"F32","shape":[1],"data_offsets":[4,8])") + "}", f8),
       "bytes [0, 4) of the data buffer belong to no tensor"},
      {"trailing bytes", Image("{" + tensor("a", R"("dtype":"F32","shape":[1],"data_offsets":[0,4])") + "}", f8),
       "bytes [4, 8) at the end of the data buffer belong to no tensor"},
      {"metadata not an object", Image(R"({"__metadata__": [1]})", ""), "__metadata__ is not a JSON object"},
      {"metadata value not a string", Image(R"({"__metadata__": {"a": 1}})", ""),
       "__metadata__[\"a\"] is not a string"},
  };
}

TEST(SafetensorsTest, MalformedFilesAreInvalidArgumentNamingTheProblem) {
  for (const MalformedCase& test_case : MalformedCorpus()) {
    const absl::Status status =
        SafetensorsFile::FromBuffer(test_case.image, "bad.safetensors").status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << test_case.name << ": " << status;
    EXPECT_NE(status.message().find(test_case.message_part), std::string::npos)
        << test_case.name << ": got \"" << status.message() << "\"";
    EXPECT_EQ(status.message().rfind("bad.safetensors", 0), 0u)
        << test_case.name << ": the message must name the file: " << status.message();
  }
}

TEST(SafetensorsTest, MalformedFilesOnDiskAreRefusedThroughTheMapping) {
  TempDir dir;
  for (const MalformedCase& test_case : MalformedCorpus()) {
    const std::string path = dir.Write("bad.safetensors", test_case.image);
    const absl::Status status = SafetensorsFile::Open(path, {}, "bad.safetensors").status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << test_case.name << ": " << status;
  }
}

TEST(SafetensorsTest, EveryTruncationIsRefused) {
  const std::string valid = ValidImage();
  ASSERT_TRUE(SafetensorsFile::FromBuffer(valid, "v").ok());
  for (size_t length = 0; length < valid.size(); ++length) {
    const absl::Status status = SafetensorsFile::FromBuffer(valid.substr(0, length), "v").status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << "length " << length;
  }
}

TEST(SafetensorsTest, RandomCorruptionNeverCrashes) {
  const uint64_t seed = 20240607;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::string valid = ValidImage();
  for (int trial = 0; trial < 2000; ++trial) {
    std::string image = valid;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) image[rng() % image.size()] = static_cast<char>(rng());
    auto file = SafetensorsFile::FromBuffer(image, "v");
    if (file.ok()) {
      for (const auto& [name, tensor] : (*file)->tensors()) (void)(*file)->ReadFloats(tensor);
    } else {
      EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << file.status();
    }
  }
}

TEST(SafetensorsTest, WriterRefusesInconsistentEntries) {
  const std::string bytes(8, '\0');
  auto mismatch = SafetensorsHeader({{"t", DType::kFloat32, {3}, bytes}}, {});
  EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(mismatch.status().message().find("\"t\" has 8 bytes; shape [3] of F32 needs 12"),
            std::string::npos)
      << mismatch.status();
  auto repeated =
      SafetensorsHeader({{"t", DType::kFloat32, {2}, bytes}, {"t", DType::kFloat32, {2}, bytes}}, {});
  EXPECT_EQ(repeated.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SafetensorsTest, OptionsAreValidated) {
  SafetensorsOptions options;
  options.max_header_bytes = 1;
  const absl::Status status = SafetensorsFile::FromBuffer(ValidImage(), "v", options).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("max_header_bytes = 1"), std::string::npos) << status;
  options.max_header_bytes = 16;  // smaller than the valid file's header
  EXPECT_NE(SafetensorsFile::FromBuffer(ValidImage(), "v", options)
                .status()
                .message()
                .find("exceeds the limit of 16 bytes"),
            std::string::npos);
}

}  // namespace
}  // namespace attention::core
