/* tensorport's shim over libjpeg(-turbo)'s decompressor: the only C in the project.
 *
 * libjpeg reports errors by calling error_exit, which by default prints and calls exit(). Here it
 * longjmps back to the shim function that called into libjpeg, so a broken file becomes an error
 * code and a message, and no Rust frame is ever jumped over: every setjmp is in this file and
 * every longjmp comes from libjpeg code called from the same function.
 *
 * The decoder decodes a window: rows [top, top + rows) and the iMCU-aligned columns around
 * [left, left + cols). Rows above the window are entropy-decoded and dropped
 * (jpeg_skip_scanlines), rows below are never decoded (jpeg_abort_decompress), and columns
 * outside it skip the inverse DCT, upsampling and colour conversion (jpeg_crop_scanline). */
#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

#define TP_MSG 200
/* A progressive file may hold many scans, each a pass over the whole coefficient buffer; a
 * crafted file with thousands of tiny scans costs minutes. Real encoders write at most ~10. */
#define TP_MAX_SCANS 256

/* The most memory libjpeg's large arrays may take per decoder: room for the coefficients of a
 * progressive 4:4:4 file of the largest image the Rust side lets through (64 megapixels). */
#define TP_MAX_MEMORY (768L << 20)

enum { TP_OK = 0, TP_ERROR = 1, TP_UNSUPPORTED = 2, TP_TOO_LARGE = 3, TP_STATE = 4, TP_BUFFER = 5 };

struct tp_jpeg_err {
  struct jpeg_error_mgr mgr;
  jmp_buf jump;
};

typedef struct tp_jpeg {
  struct jpeg_decompress_struct dec;
  struct tp_jpeg_err err;
  struct jpeg_progress_mgr progress;
  char message[TP_MSG];
  int warnings;
  int header_read;
} tp_jpeg;

static void tp_error_exit(j_common_ptr c) {
  tp_jpeg *t = (tp_jpeg *)c->client_data;
  c->err->format_message(c, t->message);
  longjmp(t->err.jump, 1);
}

static void tp_output_message(j_common_ptr c) {
  /* Warnings (a truncated scan, junk between markers) are counted, not printed: the decoder
   * goes on, filling what is missing, as libjpeg does by default. */
  tp_jpeg *t = (tp_jpeg *)c->client_data;
  if (t->warnings++ == 0) c->err->format_message(c, t->message);
}

static void tp_progress(j_common_ptr c) {
  j_decompress_ptr d = (j_decompress_ptr)c;
  if (d->input_scan_number > TP_MAX_SCANS) {
    tp_jpeg *t = (tp_jpeg *)c->client_data;
    snprintf(t->message, TP_MSG, "more than %d progressive scans", TP_MAX_SCANS);
    longjmp(t->err.jump, 1);
  }
}

tp_jpeg *tp_jpeg_new(void) {
  /* volatile: read again after a longjmp back into this frame. */
  tp_jpeg *volatile t = calloc(1, sizeof(tp_jpeg));
  if (!t) return NULL;
  t->dec.err = jpeg_std_error(&t->err.mgr);
  t->err.mgr.error_exit = tp_error_exit;
  t->err.mgr.output_message = tp_output_message;
  t->dec.client_data = t;
  if (setjmp(t->err.jump)) {
    free(t);
    return NULL;
  }
  jpeg_create_decompress(&t->dec);
  /* Large virtual arrays (a progressive file's coefficients) past this fail with an error
   * instead of being allocated: a small file cannot make one decoder take gigabytes. */
  t->dec.mem->max_memory_to_use = TP_MAX_MEMORY;
  t->progress.progress_monitor = tp_progress;
  t->dec.progress = &t->progress;
  return t;
}

void tp_jpeg_free(tp_jpeg *t) {
  if (!t) return;
  jpeg_destroy_decompress(&t->dec);
  free(t);
}

const char *tp_jpeg_message(const tp_jpeg *t) { return t->message; }

int tp_jpeg_warnings(const tp_jpeg *t) { return t->warnings; }

/* Reads the header of the `len` bytes at `data`, which must stay valid until tp_jpeg_window
 * returns. Gives the image's size. Fails with TP_UNSUPPORTED for colour spaces that cannot become
 * RGB (CMYK, YCCK), TP_TOO_LARGE over `max_side` pixels a side. */
int tp_jpeg_header(tp_jpeg *t, const unsigned char *data, size_t len, uint32_t max_side,
                   uint32_t *width, uint32_t *height) {
  t->message[0] = 0;
  t->warnings = 0;
  t->header_read = 0;
  if ((unsigned long)len != len) {
    snprintf(t->message, TP_MSG, "file too large");
    return TP_TOO_LARGE;
  }
  if (setjmp(t->err.jump)) {
    jpeg_abort_decompress(&t->dec);
    return TP_ERROR;
  }
  jpeg_mem_src(&t->dec, data, (unsigned long)len);
  jpeg_read_header(&t->dec, TRUE);
  if (t->dec.image_width == 0 || t->dec.image_height == 0 || t->dec.image_width > max_side ||
      t->dec.image_height > max_side) {
    snprintf(t->message, TP_MSG, "%ux%u pixels (at most %u a side)", t->dec.image_width,
             t->dec.image_height, max_side);
    jpeg_abort_decompress(&t->dec);
    return TP_TOO_LARGE;
  }
  switch (t->dec.jpeg_color_space) {
    case JCS_GRAYSCALE:
    case JCS_YCbCr:
    case JCS_RGB:
      break;
    default:
      snprintf(t->message, TP_MSG, "colour space %d does not convert to RGB here",
               (int)t->dec.jpeg_color_space);
      jpeg_abort_decompress(&t->dec);
      return TP_UNSUPPORTED;
  }
  t->dec.out_color_space = JCS_RGB;
  *width = t->dec.image_width;
  *height = t->dec.image_height;
  t->header_read = 1;
  return TP_OK;
}

/* After tp_jpeg_header: decode at 1/denom of the size (denom 1, 2, 4 or 8: libjpeg's DCT
 * scaling, which leaves out the high frequencies instead of decoding them and resampling), and
 * gives the scaled size, which tp_jpeg_window's coordinates are then in. */
int tp_jpeg_scale(tp_jpeg *t, uint32_t denom, uint32_t *width, uint32_t *height) {
  if (!t->header_read) {
    snprintf(t->message, TP_MSG, "no header read");
    return TP_STATE;
  }
  if (!(denom == 1 || denom == 2 || denom == 4 || denom == 8)) {
    snprintf(t->message, TP_MSG, "scale 1/%u (1, 2, 4 or 8 are taken)", denom);
    return TP_STATE;
  }
  if (setjmp(t->err.jump)) {
    t->header_read = 0;
    jpeg_abort_decompress(&t->dec);
    return TP_ERROR;
  }
  t->dec.scale_num = 1;
  t->dec.scale_denom = denom;
  jpeg_calc_output_dimensions(&t->dec);
  *width = t->dec.output_width;
  *height = t->dec.output_height;
  return TP_OK;
}

/* Decodes the window after tp_jpeg_header (see the top of the file) as interleaved RGB into
 * `out` (`cap` bytes), `*out_cols` pixels a row; `*out_left` is the first column decoded.
 * top + rows and left + cols must lie inside the image. */
int tp_jpeg_window(tp_jpeg *t, uint32_t left, uint32_t cols, uint32_t top, uint32_t rows,
                   unsigned char *out, size_t cap, uint32_t *out_left, uint32_t *out_cols) {
  if (!t->header_read) {
    snprintf(t->message, TP_MSG, "no header read");
    return TP_STATE;
  }
  t->header_read = 0;
  if (setjmp(t->err.jump)) {
    jpeg_abort_decompress(&t->dec);
    return TP_ERROR;
  }
  /* The output size: the image's, or its scaled one (tp_jpeg_scale). */
  jpeg_calc_output_dimensions(&t->dec);
  JDIMENSION ow = t->dec.output_width, oh = t->dec.output_height;
  if (cols == 0 || rows == 0 || cols > ow || rows > oh || left > ow - cols || top > oh - rows) {
    snprintf(t->message, TP_MSG, "window outside the image");
    jpeg_abort_decompress(&t->dec);
    return TP_STATE;
  }
  jpeg_start_decompress(&t->dec);
  JDIMENSION x = left, w = cols;
  if (left != 0 || cols != t->dec.output_width) jpeg_crop_scanline(&t->dec, &x, &w);
  size_t stride = (size_t)w * 3;
  if (stride * rows > cap) {
    snprintf(t->message, TP_MSG, "output buffer of %zu bytes, %zu needed", cap, stride * rows);
    jpeg_abort_decompress(&t->dec);
    return TP_BUFFER;
  }
  if (top > 0 && jpeg_skip_scanlines(&t->dec, top) != top) {
    snprintf(t->message, TP_MSG, "could not skip %u rows", top);
    jpeg_abort_decompress(&t->dec);
    return TP_ERROR;
  }
  while (t->dec.output_scanline < top + rows) {
    JSAMPROW row = out + (size_t)(t->dec.output_scanline - top) * stride;
    if (jpeg_read_scanlines(&t->dec, &row, 1) != 1) {
      snprintf(t->message, TP_MSG, "no more rows at row %u", t->dec.output_scanline);
      jpeg_abort_decompress(&t->dec);
      return TP_ERROR;
    }
  }
  /* The rows below the window are not needed: stop here, leaving the object ready for the
   * next file. */
  jpeg_abort_decompress(&t->dec);
  *out_left = x;
  *out_cols = w;
  return TP_OK;
}

/* Forgets a header read but not decoded. */
void tp_jpeg_abort(tp_jpeg *t) {
  t->header_read = 0;
  jpeg_abort_decompress(&t->dec);
}
