// The GPU's YCbCr kernel (src/ycc.rs), compiled for the host, against libjpeg-turbo's own
// decode: JPEGs of many sizes (odd ones, planes two samples wide or less) with 4:4:4, 4:2:2 and
// 4:2:0 chroma, and grayscale ones, are encoded here, decoded once as libjpeg decodes them
// (fancy upsampling, YCbCr to RGB) and once as raw planes (as the JPEG engines give them); the
// kernel turns the planes into RGB, which must equal libjpeg's bit for bit. Built and run by
// tests/ycc_host.rs, which writes the kernel's source to kernel.inc beside it. Exit status 0 when
// every case matches.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <jpeglib.h>
using std::min; using std::max;
#define __device__
#define __forceinline__ inline
#define __global__
struct D3 { int x, y, z; };
static D3 blockIdx{0,0,0}, blockDim{1,1,1}, gridDim{1,1,1}, threadIdx{0,0,0};
#include "kernel.inc"

// A w x h JPEG of a noisy gradient: YCbCr with luma sampled hs x vs (hs = 0: grayscale).
static std::vector<unsigned char> encode(int w, int h, int hs, int vs, int q, unsigned seed) {
  jpeg_compress_struct c; jpeg_error_mgr e; c.err = jpeg_std_error(&e); jpeg_create_compress(&c);
  unsigned char* out = nullptr; unsigned long len = 0; jpeg_mem_dest(&c, &out, &len);
  const int n = hs ? 3 : 1;
  c.image_width = w; c.image_height = h; c.input_components = n;
  c.in_color_space = hs ? JCS_RGB : JCS_GRAYSCALE;
  jpeg_set_defaults(&c); jpeg_set_quality(&c, q, TRUE);
  if (hs) { c.comp_info[0].h_samp_factor = hs; c.comp_info[0].v_samp_factor = vs; }
  jpeg_start_compress(&c, TRUE);
  std::vector<unsigned char> row(w * n); srand(seed);
  for (int y = 0; y < h; ++y) {
    for (int x = 0; x < w * n; ++x) row[x] = (unsigned char)(((x * 7 + y * 13) % 256 + rand() % 64) & 255);
    JSAMPROW r = row.data(); jpeg_write_scanlines(&c, &r, 1);
  }
  jpeg_finish_compress(&c); jpeg_destroy_compress(&c);
  std::vector<unsigned char> v(out, out + len); free(out); return v;
}

int main() {
  int fails = 0, cases = 0;
  int sizes[][2] = {{1,1},{2,2},{3,3},{4,3},{5,7},{16,16},{17,9},{33,31},{64,48},{101,67},{640,480},{641,479}};
  int samp[][2] = {{1,1},{2,1},{2,2},{0,0}};
  for (auto& s : sizes) for (auto& f : samp) for (int q : {60, 95}) {
    auto jpg = encode(s[0], s[1], f[0], f[1], q, s[0] * 31 + s[1]);
    // libjpeg's own decode: fancy upsampling, YCbCr -> RGB.
    jpeg_decompress_struct d; jpeg_error_mgr e; d.err = jpeg_std_error(&e); jpeg_create_decompress(&d);
    jpeg_mem_src(&d, jpg.data(), jpg.size()); jpeg_read_header(&d, TRUE);
    d.out_color_space = JCS_RGB; jpeg_start_decompress(&d);
    int w = d.output_width, h = d.output_height;
    std::vector<unsigned char> rgb(w * h * 3);
    while ((int)d.output_scanline < h) { JSAMPROW r = &rgb[d.output_scanline * w * 3]; jpeg_read_scanlines(&d, &r, 1); }
    jpeg_finish_decompress(&d); jpeg_destroy_decompress(&d);
    // Raw planes.
    jpeg_create_decompress(&d); jpeg_mem_src(&d, jpg.data(), jpg.size()); jpeg_read_header(&d, TRUE);
    d.raw_data_out = TRUE; jpeg_start_decompress(&d);
    int hmax = d.max_h_samp_factor, vmax = d.max_v_samp_factor;
    const int comps = d.num_components;
    std::vector<std::vector<unsigned char>> pad(3); int pw[3] = {0,0,0}, ph[3], cw[3] = {w,w,w}, ch[3] = {h,h,h};
    for (int c = 0; c < comps; ++c) {
      auto* ci = &d.comp_info[c];
      pw[c] = ci->width_in_blocks * 8; ph[c] = ((ci->height_in_blocks + ci->v_samp_factor) / ci->v_samp_factor) * ci->v_samp_factor * 8 + 64;
      pad[c].assign((size_t)pw[c] * ph[c], 0);
      cw[c] = (w * ci->h_samp_factor + hmax - 1) / hmax; ch[c] = (h * ci->v_samp_factor + vmax - 1) / vmax;
    }
    int done[3] = {0,0,0};
    while ((int)d.output_scanline < h) {
      std::vector<JSAMPROW> rows[3]; JSAMPARRAY arr[3];
      for (int c = 0; c < comps; ++c) {
        int n = d.comp_info[c].v_samp_factor * 8;
        for (int k = 0; k < n; ++k) rows[c].push_back(&pad[c][(size_t)(done[c] + k) * pw[c]]);
        arr[c] = rows[c].data();
      }
      int got = jpeg_read_raw_data(&d, arr, vmax * 8);
      if (got == 0) break;
      for (int c = 0; c < comps; ++c) done[c] += d.comp_info[c].v_samp_factor * 8;
    }
    jpeg_abort_decompress(&d); jpeg_destroy_decompress(&d);
    // Tight planes, as nvJPEG writes them: Y w x h, chroma cw x ch (a grayscale image's room
    // for two more planes of its size, unread).
    std::vector<unsigned char> planes;
    for (int c = 0; c < comps; ++c) for (int y = 0; y < ch[c]; ++y) planes.insert(planes.end(), &pad[c][(size_t)y * pw[c]], &pad[c][(size_t)y * pw[c]] + cw[c]);
    if (comps == 1) planes.resize((size_t)w * h * 3, 0);
    int css = f[0] == 1 ? 0 : (f[1] == 1 ? 1 : 2);
    int mode = comps == 1 ? 5 : css == 0 ? 0 : (cw[1] > 2 ? css : css + 2);
    std::vector<unsigned char> out(w * h * 3);
    Ycc job{planes.data(), planes.data() + w * h, planes.data() + w * h + cw[1] * ch[1], out.data(), w, h, cw[1], ch[1], mode, 0};
    tp_ycc_rgb(&job);
    int bad = 0, worst = 0;
    for (int y = 0; y < h; ++y) for (int x = 0; x < w; ++x) for (int c = 0; c < 3; ++c) {
      int a = out[(size_t)c * w * h + y * w + x], b = rgb[(y * w + x) * 3 + c];
      if (a != b) { ++bad; worst = max(worst, abs(a - b)); }
    }
    ++cases;
    if (bad) { ++fails; printf("%dx%d samp %dx%d q%d mode %d: %d samples differ, worst %d\n", w, h, f[0], f[1], q, mode, bad, worst); }
  }
  printf("%d cases, %d differ\n", cases, fails);
  return fails != 0;
}
