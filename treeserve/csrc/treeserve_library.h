// The torch library an operator source registers into: `treeserve`, unless the build defines
// TREESERVE_LIBRARY (a test builds a source a second time, for another instruction set, under another
// name: tests/_isa_builds.py). TREESERVE_FRAGMENT / TREESERVE_IMPL expand that name before torch's
// macros paste it into their identifiers.
#pragma once

#include <torch/library.h>

#ifndef TREESERVE_LIBRARY
#define TREESERVE_LIBRARY treeserve
#endif
#define TREESERVE_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define TREESERVE_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)
