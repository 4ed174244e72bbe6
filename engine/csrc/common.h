/* Helpers shared by the CPU kernels: bfloat16 conversions and a vectorizable exp. */
#ifndef SPLITSERVE_COMMON_H
#define SPLITSERVE_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    bits += 0x7FFFu + ((bits >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

/* exp(x) to ~2e-7 relative error, written so the compiler vectorizes it (libm's
   expf is a scalar call per score). Range reduction to 2^n * 2^f, |f| <= 0.5,
   then a degree-7 Taylor polynomial of 2^f; -inf and tiny inputs give ~0. */
static inline float fast_expf(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float t = x * 1.44269504088896341f;
    const float n = floorf(t + 0.5f);
    const float f = t - n;
    float p = 1.5252733804059841e-5f;
    p = p * f + 1.5403530393381609e-4f;
    p = p * f + 1.3333558146428443e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    p = p * f + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* value rounded to the nearest bfloat16, kept as float: where a bf16 PyTorch op rounds its output.
   Pure 32-bit integer steps: a round trip through uint16_t vectorizes far worse
   (docs/benchmarks.md, "Offline throughput"). */
static inline float bf16_round(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&value, &bits, sizeof value);
    return value;
}

#endif
