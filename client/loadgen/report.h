// attention-loadgen's report: a table on stdout and, with --json, a JSON file.
#ifndef ATTENTION_CLIENT_LOADGEN_REPORT_H_
#define ATTENTION_CLIENT_LOADGEN_REPORT_H_

#include <string>

#include "client/loadgen/config.h"
#include "client/loadgen/recorder.h"

namespace attention::loadgen {

// The configuration and the report as a JSON object (nulls for latencies without answers).
std::string ToJson(const Config& c, const Report& r);

// The human-readable report on stdout.
void PrintReport(const Config& c, const Report& r);

}  // namespace attention::loadgen

#endif  // ATTENTION_CLIENT_LOADGEN_REPORT_H_
