// Lookup-table ternary GEMMs for measurement only, beside the product's vpdpbusd kernel
// (docs/bitnet.md, "The kernel"; benchmarks/cpu/ternary_lut.py builds and times them). AVX-512BW (tl2v: and VBMI).
// Both compute dot(w, a) exactly in integers (int16 partial sums, widened to int32 every kFlush
// groups of 3 k: |sum| <= 64 * 3 * 128 < 2^15), so the output equals kernels/ternary.py's twin.
//
// tl2: bitnet.cpp's TL2 method on 512-bit vectors. Three consecutive k make a group; its 27 weight
//   triples are 13 canonical ones (first nonzero weight +1), their negations and zero: a 4-bit
//   index (two groups a byte) and a sign bit, 5 bits per 3 weights (1.67 bits a weight). Each row's
//   table holds a group's 16 int16 partial sums as a 16-byte low-byte table and a high-byte one;
//   vpshufb looks 64 columns up in each, vpunpck{l,h}bw joins the bytes into int16, the sign bit
//   (an AVX-512 mask) negates. Panels of 64 columns in blocks of 4 pairs of groups (24 k): the 4
//   pairs' 64 index bytes, then their four 32-bit sign masks each (320 bytes, every load aligned).
// tl2v: the same bytes, the sign bits in column order (one 64-bit mask a group): a masked add puts
//   the sign in bit 4 of the index, and vpermb (AVX-512 VBMI) looks it up in one 64-byte table a
//   group and row (the 16 sums' low bytes, their negations' low bytes, then the high bytes), so no
//   broadcast and no negation per row.
// perm27: the 27 sums of a group as one vector of 32 int16 entries, looked up by vpermw with a
//   5-bit index (no sign, no byte split): three groups' indices in one 16-bit word (9 weights in
//   16 bits: 1.78 bits a weight), shifted by 5 and 10 for the next two. Panels of 32 columns.
#include "ternary_lut.h"

using namespace ternary_lut;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_tl2", [](const at::Tensor& w) { return pack_tl2(w, false); });
  m.def("linear_tl2", &linear_tl2<false>);
  m.def("pack_tl2v", [](const at::Tensor& w) { return pack_tl2(w, true); });
  m.def("linear_tl2v", &linear_tl2<true>);
  m.def("pack_perm27", &pack_perm27);
  m.def("linear_perm27", &linear_perm27);
}
