// PLACEHOLDER
#include <pybind11/pybind11.h>
PYBIND11_MODULE(_block_manager, m) { m.doc() = "placeholder"; }
