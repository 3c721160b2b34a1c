// ops.h once per ISA variant: every variant's declarations, for the sources compiled once for all
// of them (bindings.cpp registers each variant's ops; fused/decoder_layer.cpp calls them). Declared
// is not built: only the variants kernels/cpu/build.py passes as -DORCA_BUILT_<VARIANT> may be used.
#pragma once

#define ORCA_ISA generic
#include "ops.h"
#undef ORCA_ISA
#define ORCA_ISA avx2
#include "ops.h"
#undef ORCA_ISA
#define ORCA_ISA avx512
#include "ops.h"
#undef ORCA_ISA
#define ORCA_ISA avx512_bf16
#include "ops.h"
#undef ORCA_ISA
#define ORCA_ISA amx
#include "ops.h"
#undef ORCA_ISA
