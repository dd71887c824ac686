// The AMX tile configuration shared by the tile kernels (gemm_amx.cpp, attention_amx.cpp).
// Included only by files built with -mamx-tile -mamx-bf16 into the AVX512_BF16 variant
// (CMakeLists.txt), so every copy of these inline functions is compiled alike.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace pagedkv::cpu::CPU_CAPABILITY {

// Palette 1's configuration block, as ldtilecfg reads it.
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// All eight tiles 16 rows x 64 bytes: a 16 x 16 fp32 sum, a 16 x 32 bf16 A operand, or a
// 16-pair x 16-column B operand (bf16 pairs). Each thread loads this before its first tile
// instruction and releases the tile state after its last (_tile_release).
inline void configure_amx_tiles() {
  AmxTileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  // GCC's _tile_loadconfig tells the compiler it reads 8 bytes of the block, so once inlined
  // the stores of rows and colsb were dropped as dead (and the first tile instruction raised
  // SIGILL): the barrier makes the whole block be written first.
  __asm__ __volatile__("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

}  // namespace pagedkv::cpu::CPU_CAPABILITY
