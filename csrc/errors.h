// Exceptions the Python layer maps to ValueError (bad input, bad files) and KeyError (unknown ids).
#pragma once

#include <stdexcept>
#include <string>

namespace agentaccel {

struct InvalidInput : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

struct UnknownKey : std::out_of_range {
  using std::out_of_range::out_of_range;
};

}  // namespace agentaccel
