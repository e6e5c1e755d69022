// A planted violation for the layering check's own test (tests/check_layering.cmake): an
// executor that includes a layout reader. Never compiled.
#include "exec/tasks.hpp"
#include "layouts/layout.hpp"
