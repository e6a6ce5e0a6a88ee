//! `tensorport weights` and `tensorport images`: files to try things with.

use std::path::PathBuf;

use tensorport_dfdx::dfdx::prelude::Cpu;
use tensorport_dfdx::{ImageClassifier, ModelConfig};

use crate::common::{CliError, CliResult};

/// Write the model's weights for a seed as a safetensors file (PyTorch layouts; see
/// docs/model.md), to load with `--weights` or to replace with trained ones of the same shape.
#[derive(clap::Args, Debug)]
pub struct WeightsArgs {
    /// File to write.
    #[arg(long, short)]
    pub out: PathBuf,
    /// Seed for the weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Number of output classes.
    #[arg(long, default_value_t = tensorport_dfdx::ModelConfig::default().classes)]
    pub classes: usize,
    /// Channels of the first stage.
    #[arg(long, default_value_t = tensorport_dfdx::ModelConfig::default().width)]
    pub width: usize,
}

pub fn weights(a: WeightsArgs) -> CliResult<u8> {
    let cfg = ModelConfig {
        image_size: ModelConfig::default().image_size,
        classes: a.classes,
        width: a.width,
    };
    ImageClassifier::<Cpu>::save_seeded(cfg, a.seed, &a.out)?;
    println!("wrote {}", a.out.display());
    Ok(0)
}

/// Write sample images (half PNG, half JPEG, of assorted sizes).
#[derive(clap::Args, Debug)]
pub struct ImagesArgs {
    /// Folder to write into (created if missing).
    #[arg(long, short)]
    pub out: PathBuf,
    /// How many images.
    #[arg(long, default_value_t = 16)]
    pub count: u64,
}

pub fn images(a: ImagesArgs) -> CliResult<u8> {
    std::fs::create_dir_all(&a.out)
        .map_err(|e| CliError::usage(format!("cannot create {}: {e}", a.out.display())))?;
    for i in 0..a.count {
        let (w, h) = (96 + (i as u32 % 4) * 40, 80 + (i as u32 % 3) * 48);
        let img = tensorport_vision::synthetic(1000 + i, w, h);
        let name = if i % 2 == 0 {
            format!("sample-{i:03}.png")
        } else {
            format!("sample-{i:03}.jpg")
        };
        img.save(a.out.join(&name))
            .map_err(|e| CliError::new(format!("cannot write {name}: {e}")))?;
    }
    println!("wrote {} images to {}", a.count, a.out.display());
    Ok(0)
}
