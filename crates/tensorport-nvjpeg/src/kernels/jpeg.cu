
struct Job {
    const unsigned char* src;
    unsigned long long pitch;
    unsigned long long plane;
    int w, h;
    float left, top, sx, sy;
    float* dst;
};

__device__ __forceinline__ float tri(float x) {
    x = fabsf(x);
    return x < 1.0f ? 1.0f - x : 0.0f;
}

__device__ __forceinline__ float round_u8(float v) {
    v = floorf(v + 0.5f);
    return fminf(fmaxf(v, 0.0f), 255.0f);
}

// PIL's antialiased bilinear taps for one output coordinate: source pixels [lo, hi), the
// filter's scale and the weights' normaliser.
__device__ __forceinline__ void taps(double center, float scale, int size,
                                     int* lo, int* hi, float* inv, float* norm) {
    float fs = scale > 1.0f ? scale : 1.0f;
    int a = (int)(center - fs + 0.5);
    int b = (int)(center + fs + 0.5);
    if (a < 0) a = 0;
    if (b > size) b = size;
    float s = 0.0f;
    for (int j = a; j < b; ++j) s += tri((float)(j - center + 0.5) / fs);
    *lo = a;
    *hi = b;
    *inv = 1.0f / fs;
    *norm = s > 0.0f ? 1.0f / s : 0.0f;
}

// Horizontal taps whose weights a thread keeps while it filters its rows; a window wider than
// this (a shrink of more than 16 times) has its weights computed again for each row.
#define TP_KEPT_TAPS 32

extern "C" __global__ void tp_resize_normalise(const Job* jobs, int out, int as_u8,
        float m0, float m1, float m2, float s0, float s1, float s2) {
    const Job j = jobs[blockIdx.z];
    const int x = blockIdx.x * blockDim.x + threadIdx.x;
    const int y = blockIdx.y;
    if (x >= out) return;
    const double cx = (double)j.left + (x + 0.5) * (double)j.sx;
    const double cy = (double)j.top + (y + 0.5) * (double)j.sy;
    int x0, x1, y0, y1;
    float ix, iy, nx, ny;
    taps(cx, j.sx, j.w, &x0, &x1, &ix, &nx);
    taps(cy, j.sy, j.h, &y0, &y1, &iy, &ny);
    const float mean[3] = {m0, m1, m2};
    const float sd[3] = {s0, s1, s2};
    // The horizontal weights are the same for every row and channel: computed once.
    float wx[TP_KEPT_TAPS];
    const bool kept = x1 - x0 <= TP_KEPT_TAPS;
    if (kept) {
        for (int xx = x0; xx < x1; ++xx) wx[xx - x0] = tri((float)(xx - cx + 0.5) * ix) * nx;
    }
    // PIL's two passes: each row's horizontal sum rounded to 8 bits, then the vertical one.
    float acc[3] = {0.0f, 0.0f, 0.0f};
    for (int yy = y0; yy < y1; ++yy) {
        const float wy = tri((float)(yy - cy + 0.5) * iy) * ny;
        for (int c = 0; c < 3; ++c) {
            const unsigned char* row = j.src + c * j.plane + (unsigned long long)yy * j.pitch;
            float h = 0.0f;
            if (kept) {
                for (int xx = x0; xx < x1; ++xx) h += wx[xx - x0] * (float)row[xx];
            } else {
                for (int xx = x0; xx < x1; ++xx) {
                    h += tri((float)(xx - cx + 0.5) * ix) * nx * (float)row[xx];
                }
            }
            acc[c] += wy * round_u8(h);
        }
    }
    for (int c = 0; c < 3; ++c) {
        const float v = round_u8(acc[c]);
        const unsigned long long at = ((unsigned long long)c * out + y) * out + x;
        if (as_u8) {
            ((unsigned char*)j.dst)[at] = (unsigned char)v;
        } else {
            j.dst[at] = (v / 255.0f - mean[c]) / sd[c];
        }
    }
}
