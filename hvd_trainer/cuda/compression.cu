// Gradient codecs of compression.py as CUDA kernels; loaded by compression.py.
#define GRID_LOOP(k, n) for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; \
                            k < (n); k += (long long)blockDim.x * gridDim.x)

// Byte k holds elements 4k..4k+3, the first in bits 7-6: 11 is +t, 10 is -t, 00 is 0.
extern "C" __global__ void encode_2bit(const float* g, float* r, unsigned char* out,
                                       long long n, long long nbytes, const float* tp) {
    const float t = *tp;
    GRID_LOOP(k, nbytes) {
        unsigned int byte = 0;
        for (int j = 0; j < 4; ++j) {
            long long i = 4 * k + j;
            if (i >= n) break;
            float v = r[i] + g[i];
            unsigned int code = 0;
            if (v >= t) { code = 3; v -= t; }
            else if (v <= -t) { code = 2; v += t; }
            r[i] = v;
            byte |= code << (6 - 2 * j);
        }
        out[k] = (unsigned char)byte;
    }
}

// Byte k holds elements 8k..8k+7, the first in bit 7: 1 is +1 (residual above t), 0 is -1.
extern "C" __global__ void encode_1bit(const float* g, float* r, unsigned char* out,
                                       long long n, long long nbytes, float t) {
    GRID_LOOP(k, nbytes) {
        unsigned int byte = 0;
        for (int j = 0; j < 8; ++j) {
            long long i = 8 * k + j;
            if (i >= n) break;
            float v = r[i] + g[i];
            bool above = v > t;
            r[i] = above ? v - 1.0f : v + 1.0f;
            byte |= (unsigned int)above << (7 - j);
        }
        out[k] = (unsigned char)byte;
    }
}

extern "C" __global__ void decode_2bit_add(const unsigned char* p, const float* tp, float* out,
                                           long long n) {
    const float t = *tp;
    GRID_LOOP(i, n) {
        unsigned int code = (p[i >> 2] >> (6 - 2 * (i & 3))) & 3;
        out[i] += code == 3 ? t : (code == 2 ? -t : 0.0f);
    }
}

extern "C" __global__ void decode_1bit_add(const unsigned char* p, float* out, long long n) {
    GRID_LOOP(i, n) {
        out[i] += ((p[i >> 3] >> (7 - (i & 7))) & 1) ? 1.0f : -1.0f;
    }
}
