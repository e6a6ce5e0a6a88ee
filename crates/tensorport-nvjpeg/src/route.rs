//! Which of a GPU producer's decoders takes each JPEG of a batch, from what its header says.
//!
//! The JPEG engines decode subsampled colour (4:2:0, 4:2:2) fast, and interpolate its chroma as
//! libjpeg-turbo does. Full-resolution chroma (4:4:4) is the engines' slow case: with
//! [`GpuDecode::ByChroma`] those files go to nvJPEG's hybrid decoder instead, Huffman decoding
//! on the producer's host threads and the rest on CUDA cores, while the engines decode the
//! others. 4:4:4 has no chroma to upsample, so both decoders give the same pixels.
//! [`GpuDecode::Split`] goes further, as DALI's `hw_decoder_load` does: any colour file may go
//! to the hybrid decoder (4:4:4 first), as many as its threads finish no later than the engines
//! (`balance.rs`). The hybrid decoder does not interpolate chroma as libjpeg-turbo does, so
//! subsampled files go there only where the run replicates chroma anyway
//! ([`crate::Upsampling::Replicate`]); with interpolation `split` shares 4:4:4 files alone.

use tensorport_vision::sniff::Chroma;

use crate::nvjpeg;

/// How a GPU producer shares its JPEGs between nvJPEG's decoders.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum GpuDecode {
    /// Every file on the batched decoder (the JPEG engines where the GPU has them).
    #[default]
    Engines,
    /// 4:4:4 files on the hybrid decoder (host threads and CUDA cores), the rest on the engines.
    ByChroma,
    /// Every colour file may go to the hybrid decoder, 4:4:4 first, shared with the engines by
    /// what each side has cost.
    Split,
}

impl GpuDecode {
    /// The name the command line uses.
    pub fn name(self) -> &'static str {
        match self {
            GpuDecode::Engines => "engines",
            GpuDecode::ByChroma => "by-chroma",
            GpuDecode::Split => "split",
        }
    }

    /// The value named `s` ([`GpuDecode::name`]).
    pub fn parse(s: &str) -> Option<GpuDecode> {
        match s {
            "engines" => Some(GpuDecode::Engines),
            "by-chroma" => Some(GpuDecode::ByChroma),
            "split" => Some(GpuDecode::Split),
            _ => None,
        }
    }
}

/// The decoder one image of a batch goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// The batched decoder: the engines interpolating chroma (or, on a GPU without engines,
    /// nvJPEG's CUDA backend).
    Batched,
    /// The engines' second batched decoder, which replicates chroma: several times faster on
    /// files with none to upsample.
    BatchedPlain,
    /// The hybrid decoder on the producer's host threads.
    Hybrid,
}

/// What a GPU producer's decoder has to route with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decoders {
    /// The batched decoder is the JPEG engines' (not the CUDA backend's).
    pub engines: bool,
    /// The engines' plain (replicating) decoder was made.
    pub plain: bool,
    /// Host threads for the hybrid decoder (0: none).
    pub hybrid_threads: usize,
    /// The sharing asked for.
    pub mode: GpuDecode,
    /// How subsampled chroma is upsampled.
    pub upsampling: crate::Upsampling,
}

impl Decoders {
    /// The decoder for an image whose chroma is `chroma`: with a hybrid decoder, where it may
    /// go (the share each side gets is decided per batch, `balance.rs`).
    pub fn route(&self, chroma: Chroma) -> Route {
        let full = chroma == Chroma::Full;
        let colour = matches!(chroma, Chroma::Full | Chroma::HalfWidth | Chroma::Quarter);
        let hybrid = match self.mode {
            GpuDecode::Engines => false,
            GpuDecode::ByChroma => full,
            GpuDecode::Split => full || (colour && self.upsampling == crate::Upsampling::Replicate),
        };
        if self.engines && hybrid && self.hybrid_threads > 0 {
            return Route::Hybrid;
        }
        if self.engines && self.plain && (full || self.upsampling == crate::Upsampling::Replicate) {
            return Route::BatchedPlain;
        }
        Route::Batched
    }
}

/// The chroma of nvJPEG's `nvjpegChromaSubsampling_t` (`nvjpegGetImageInfo`'s answer).
pub fn chroma_of(subsampling: std::ffi::c_int) -> Chroma {
    match subsampling {
        nvjpeg::CSS_444 => Chroma::Full,
        nvjpeg::CSS_422 => Chroma::HalfWidth,
        nvjpeg::CSS_420 => Chroma::Quarter,
        nvjpeg::CSS_GRAY => Chroma::Gray,
        _ => Chroma::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Upsampling;

    fn on_engines(mode: GpuDecode, threads: usize) -> Decoders {
        Decoders {
            engines: true,
            plain: true,
            hybrid_threads: threads,
            mode,
            upsampling: Upsampling::Interpolate,
        }
    }

    #[test]
    fn full_chroma_goes_to_the_hybrid_decoder_the_rest_to_the_engines() {
        let d = on_engines(GpuDecode::ByChroma, 4);
        assert_eq!(d.route(Chroma::Full), Route::Hybrid);
        assert_eq!(d.route(Chroma::Quarter), Route::Batched);
        assert_eq!(d.route(Chroma::HalfWidth), Route::Batched);
        assert_eq!(d.route(Chroma::Other), Route::Batched);
    }

    #[test]
    fn split_offers_every_colour_file_to_the_hybrid_decoder_where_chroma_is_replicated() {
        let d = Decoders {
            upsampling: Upsampling::Replicate,
            ..on_engines(GpuDecode::Split, 4)
        };
        for c in [Chroma::Full, Chroma::HalfWidth, Chroma::Quarter] {
            assert_eq!(d.route(c), Route::Hybrid);
        }
        // Interpolated chroma stays on the engines, which interpolate it.
        let interpolate = on_engines(GpuDecode::Split, 4);
        assert_eq!(interpolate.route(Chroma::Full), Route::Hybrid);
        assert_eq!(interpolate.route(Chroma::Quarter), Route::Batched);
        // Gray and unusual layouts stay on the engines (their replicating decoder, as asked).
        assert_eq!(d.route(Chroma::Gray), Route::BatchedPlain);
        assert_eq!(d.route(Chroma::Other), Route::BatchedPlain);
        let no_threads = on_engines(GpuDecode::Split, 0);
        assert_eq!(no_threads.route(Chroma::Quarter), Route::Batched);
        assert_eq!(no_threads.route(Chroma::Full), Route::BatchedPlain);
    }

    #[test]
    fn names_round_trip() {
        for g in [GpuDecode::Engines, GpuDecode::ByChroma, GpuDecode::Split] {
            assert_eq!(GpuDecode::parse(g.name()), Some(g));
        }
        assert_eq!(GpuDecode::parse("fast"), None);
    }

    #[test]
    fn without_threads_or_by_choice_full_chroma_stays_on_the_plain_engines() {
        for d in [
            on_engines(GpuDecode::ByChroma, 0),
            on_engines(GpuDecode::Engines, 4),
        ] {
            assert_eq!(d.route(Chroma::Full), Route::BatchedPlain);
            assert_eq!(d.route(Chroma::Quarter), Route::Batched);
        }
        let replicate = Decoders {
            upsampling: Upsampling::Replicate,
            ..on_engines(GpuDecode::Engines, 4)
        };
        assert_eq!(replicate.route(Chroma::Quarter), Route::BatchedPlain);
    }

    #[test]
    fn a_gpu_without_engines_batches_everything_on_cuda() {
        let d = Decoders {
            engines: false,
            plain: false,
            ..on_engines(GpuDecode::ByChroma, 4)
        };
        for c in [Chroma::Full, Chroma::Quarter, Chroma::HalfWidth] {
            assert_eq!(d.route(c), Route::Batched);
        }
    }

    #[test]
    fn nvjpegs_subsampling_names_the_same_chroma_as_the_frame_header() {
        assert_eq!(chroma_of(nvjpeg::CSS_444), Chroma::Full);
        assert_eq!(chroma_of(nvjpeg::CSS_422), Chroma::HalfWidth);
        assert_eq!(chroma_of(nvjpeg::CSS_420), Chroma::Quarter);
        assert_eq!(chroma_of(nvjpeg::CSS_GRAY), Chroma::Gray);
        assert_eq!(chroma_of(3), Chroma::Other);
        assert_eq!(chroma_of(-1), Chroma::Other);
    }
}
