//! `tensorport produce`: one producer process.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tensorport::{Producer, ProducerConfig, TensorSpec};
use tensorport_dfdx::scores_from_bytes;
use tensorport_vision::Source;

use crate::common::{
    argmax, CliError, CliResult, PixelsArg, ResultLine, SocketArg, StageTimes, TransformArg,
};

/// Preprocess images into shared memory and have the server classify them. Each image is decoded,
/// resized and cropped to --image-size (see --transform) and normalised straight into a slot of
/// this producer's pool (no copy), then submitted; up to --in-flight requests are outstanding at
/// once. Files are read ahead on a thread of their own. Writes one JSON line per input:
/// {"index", "input", "class", "scores", "latency_ms", "producer"} (or "error"), plus "stages"
/// with --profile.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub socket: SocketArg,
    /// Folder of PNG/JPEG images to classify.
    #[arg(long, conflicts_with_all = ["synthetic", "worklist"])]
    pub input: Option<PathBuf>,
    /// Classify N generated images instead of files.
    #[arg(long, value_name = "N", conflicts_with = "worklist")]
    pub synthetic: Option<u64>,
    /// Read inputs from stdin, one `INDEX<TAB>SOURCE` per line (SOURCE: a path or synthetic:N),
    /// until end of input. This is how `tensorport farm` drives producers.
    #[arg(long)]
    pub worklist: bool,
    /// Where to write the JSON lines (`-` for stdout).
    #[arg(long, short, default_value = "-")]
    pub output: PathBuf,
    /// Side of the square images the server's model takes, in pixels.
    #[arg(long, default_value_t = 224)]
    pub image_size: usize,
    /// Requests outstanding at once (also the number of slots asked for).
    #[arg(long, default_value_t = 4)]
    pub in_flight: u32,
    /// The tensors are ready: prepare the first input once, and hand a copy of it over for every
    /// input (measures the hand-off without the preprocessing).
    #[arg(long)]
    pub ready: bool,
    /// The preprocessing.
    #[arg(long, value_enum, default_value_t)]
    pub transform: TransformArg,
    /// The CPU's JPEG decoder (the default: libjpeg-turbo where it was built in).
    #[arg(long, value_enum, default_value_t)]
    pub jpeg_decoder: crate::common::JpegDecoderArg,
    /// Images over this many megapixels are refused (an error line naming the file) before
    /// anything is allocated for them: a small file can declare an image of gigabytes.
    #[arg(long, default_value_t = 64.0, value_name = "MP")]
    pub max_megapixels: f64,
    /// Decode large JPEGs at 1/2, 1/4 or 1/8 of their size with libjpeg-turbo's DCT scaling
    /// whenever that still leaves a source pixel for each output pixel (as PIL's `draft`
    /// does): less work on big photos, but the tensors differ from torchvision's full decode
    /// by more than the default's bound (docs/operations.md), so it is off unless asked for.
    #[arg(long, value_enum, default_value_t = crate::common::Switch::Off)]
    pub dct_scaling: crate::common::Switch,
    /// What to hand over per image: normalised f32 planes, or u8 planes (4× fewer bytes; the
    /// server normalises them to the same floats).
    #[arg(long, value_enum, default_value_t)]
    pub pixels: PixelsArg,
    /// Add each input's time per step (read, decode, resize, normalise, lease, submit, result)
    /// to its line, as "stages".
    #[arg(long)]
    pub profile: bool,
    /// Name shown in the server's logs and status.
    #[arg(long, default_value = "producer")]
    pub name: String,
    /// How long to wait for a free slot or a result before giving up, in seconds.
    #[arg(long, default_value_t = 60)]
    pub timeout: u64,
    /// Microseconds to poll for results before sleeping on the doorbell (see `serve --spin-us`).
    #[arg(long, default_value_t = 20)]
    pub spin_us: u64,
    /// Decode and prepare on the GPU: JPEGs in batches with nvJPEG (the GPU's hardware JPEG
    /// decoder where it has one), resized, cropped and normalised by a kernel into device
    /// buffers handed over through CUDA IPC with fences (the server must run `--device cuda` on
    /// the same GPU). Other files (PNG, progressive JPEGs on the hardware decoder) are prepared
    /// on the CPU and copied up. Needs libnvjpeg and libnvrtc (CUDA toolkit or their wheels).
    #[arg(long, conflicts_with = "ready")]
    pub nvjpeg: bool,
    /// The GPU for --nvjpeg.
    #[arg(long, default_value_t = 0, value_name = "ORDINAL")]
    pub gpu: u32,
    /// Images per nvJPEG batch (at most --in-flight).
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
}

/// An input, with its file's bytes read ahead (or why they could not be), and how long the read
/// took.
pub(crate) type Item = (
    u64,
    Source,
    Option<(tensorport_vision::Result<Vec<u8>>, Duration)>,
);

enum Work {
    Item(Item),
    Wait,
    Done,
}

/// Reads a file's bytes into `buf` (reused), timing it.
pub(crate) fn read_ahead(
    src: &Source,
    mut buf: Vec<u8>,
) -> Option<(tensorport_vision::Result<Vec<u8>>, Duration)> {
    let Source::File(path) = src else {
        return None;
    };
    let t = Instant::now();
    let r = tensorport_vision::read_file(path, &mut buf).map(|()| buf);
    Some((r, t.elapsed()))
}

pub fn run(a: Args) -> CliResult<ExitCode> {
    let size = a.image_size;
    if size == 0 {
        return Err(CliError::usage("--image-size must be positive"));
    }
    let (rx, spent) = start_inputs(&a)?;
    let mut out = open_output(&a)?;
    if a.nvjpeg {
        crate::produce_gpu::run(&a, rx, spent, &mut out)?;
        return Ok(ExitCode::SUCCESS);
    }
    let image_bytes = (3 * size * size * a.pixels.bytes()) as u64;
    let mut cfg = ProducerConfig::new(a.name.clone());
    cfg.slots = a.in_flight.max(1);
    cfg.slot_size = image_bytes;
    cfg.spin = Duration::from_micros(a.spin_us);
    let mut p = Producer::connect(a.socket.path(), cfg)?;
    if p.slot_size() < image_bytes {
        return Err(CliError::new(format!(
            "the server gives slots of {} bytes, an image of {size}×{size} needs {image_bytes}; start the server with a larger --slot-size",
            p.slot_size()
        )));
    }
    let spec = TensorSpec::new(a.pixels.dtype(), &[3, size as u64, size as u64]);
    let mut prep = a.jpeg_decoder.preprocessor(
        a.transform.for_size(size as u32),
        crate::common::pixels_of(a.max_megapixels),
        a.dct_scaling.on(),
    )?;
    let ready: Option<Vec<u8>> = if a.ready {
        // Bytes, as f32 or u8 (a Vec<f32>'s buffer keeps the f32 view aligned).
        let mut px = vec![0f32; 3 * size * size];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut px);
        let bytes = &mut bytes[..image_bytes as usize];
        prep.prepare_into(&Source::Synthetic(0), a.pixels.planes(bytes)?)?;
        Some(bytes.to_vec())
    } else {
        None
    };
    let timeout = Duration::from_secs(a.timeout.max(1));
    let depth = (a.in_flight.max(1) as usize).min(p.max_in_flight() as usize);
    // Request id → (index, input, when leased, when submitted, stage times so far).
    let mut pending: HashMap<u64, (u64, String, Instant, Instant, StageTimes)> = HashMap::new();
    let mut eof = false;
    let mut written = 0u64;
    let mut emit = |out: &mut Box<dyn Write>, line: ResultLine| -> CliResult<()> {
        let s = serde_json::to_string(&line).expect("serializable");
        writeln!(out, "{s}")?;
        out.flush()?;
        written += 1;
        Ok(())
    };
    // The line for an input that gets no result from the server.
    let failed = |index: u64, source: &Source, error: String, latency_ms: f64, stages| ResultLine {
        index,
        input: source.to_string(),
        class: None,
        scores: None,
        error: Some(error),
        latency_ms,
        producer: a.name.clone(),
        stages,
    };
    loop {
        // Keep the pipeline full.
        while !eof && pending.len() < depth {
            let work = if pending.is_empty() {
                match rx.recv_timeout(Duration::from_millis(200)) {
                    Ok(it) => Work::Item(it),
                    Err(mpsc::RecvTimeoutError::Timeout) => Work::Wait,
                    Err(mpsc::RecvTimeoutError::Disconnected) => Work::Done,
                }
            } else {
                match rx.try_recv() {
                    Ok(it) => Work::Item(it),
                    Err(mpsc::TryRecvError::Empty) => Work::Wait,
                    Err(mpsc::TryRecvError::Disconnected) => Work::Done,
                }
            };
            let (index, source, bytes) = match work {
                Work::Item(it) => it,
                Work::Wait => break,
                Work::Done => {
                    eof = true;
                    break;
                }
            };
            // The request id is the input's index, so a consumer knows which input it holds
            // (a Python `Loader` yields the indices with the batch).
            if pending.contains_key(&index) {
                if let Some((Ok(buf), _)) = bytes {
                    let _ = spent.send(buf);
                }
                let why = format!("input {index} was given again while in flight");
                emit(&mut out, failed(index, &source, why, 0.0, None))?;
                continue;
            }
            let t0 = Instant::now();
            let mut lease = p.lease(timeout)?;
            let leased = Instant::now();
            let slot = &mut lease.bytes_mut()[..image_bytes as usize];
            let mut st = StageTimes {
                lease_ms: ms(leased - t0),
                ..StageTimes::default()
            };
            let prepared = match (&ready, bytes, &source) {
                (Some(px), _, _) => {
                    slot.copy_from_slice(px);
                    Ok(())
                }
                (None, Some((Ok(buf), read)), Source::File(path)) => {
                    st.read_ms = ms(read);
                    let r = prep.prepare_encoded_into(&buf, path, a.pixels.planes(slot)?);
                    let _ = spent.send(buf);
                    r
                }
                (None, Some((Err(e), _)), _) => Err(e),
                (None, _, _) => prep.prepare_into(&source, a.pixels.planes(slot)?),
            };
            if ready.is_none() {
                let s = prep.last_stages();
                st.decode_ms = ms(s.decode);
                st.resize_ms = ms(s.resize);
                st.normalise_ms = ms(s.normalise);
            }
            if let Err(e) = prepared {
                drop(lease);
                let latency = t0.elapsed().as_secs_f64() * 1e3;
                let stages = a.profile.then_some(st);
                emit(
                    &mut out,
                    failed(index, &source, e.to_string(), latency, stages),
                )?;
                continue;
            }
            let before_submit = Instant::now();
            lease.submit_as(index, &spec)?;
            let submitted = Instant::now();
            st.submit_ms = ms(submitted - before_submit);
            pending.insert(index, (index, source.to_string(), t0, submitted, st));
        }
        if pending.is_empty() {
            if eof {
                break;
            }
            continue;
        }
        // With room in the pipeline, wait for a result only briefly before looking for new
        // input again: an input that arrives while we wait must not sit idle for a whole
        // result's round trip (that starved busy producers).
        let c = if !eof && pending.len() < depth {
            match p.recv_result(Duration::from_millis(1)) {
                Ok(c) => c,
                Err(tensorport::Error::Timeout(..)) => {
                    let oldest = pending.values().map(|v| v.3).min().expect("not empty");
                    if oldest.elapsed() > timeout {
                        return Err(CliError::new(format!(
                            "no result from the server within {}s",
                            timeout.as_secs()
                        )));
                    }
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
        } else {
            p.recv_result(timeout)?
        };
        let Some((index, input, t0, submitted, mut st)) = pending.remove(&c.request_id) else {
            continue;
        };
        st.result_ms = ms(submitted.elapsed());
        emit(&mut out, result_line(&a, index, input, t0, st, c.result))?;
    }
    let _ = p.close();
    tracing::info!(results = written, "producer done");
    Ok(ExitCode::SUCCESS)
}

/// Where the result lines go: stdout or the `--output` file.
pub(crate) fn open_output(a: &Args) -> CliResult<Box<dyn Write>> {
    Ok(if a.output.as_os_str() == "-" {
        Box::new(std::io::stdout().lock())
    } else {
        Box::new(std::io::BufWriter::new(
            std::fs::File::create(&a.output).map_err(|e| {
                CliError::usage(format!("cannot create {}: {e}", a.output.display()))
            })?,
        ))
    })
}

/// Starts the thread that lists (or reads from stdin) the inputs and reads their files ahead;
/// returns the inputs' channel and where to send spent read buffers for reuse.
pub(crate) fn start_inputs(a: &Args) -> CliResult<(mpsc::Receiver<Item>, mpsc::Sender<Vec<u8>>)> {
    let items: Option<Box<dyn Iterator<Item = (u64, Source)> + Send>> =
        match (&a.input, a.synthetic, a.worklist) {
            (Some(dir), _, _) => Some(Box::new(
                crate::common::list_inputs(dir)?
                    .into_iter()
                    .enumerate()
                    .map(|(i, p)| (i as u64, Source::File(p))),
            )),
            // Lazy: `--synthetic` may be huge (the soak test runs producers that never finish).
            (None, Some(n), _) => Some(Box::new((0..n).map(|i| (i, Source::Synthetic(i))))),
            (None, None, true) => None,
            (None, None, false) => {
                return Err(CliError::usage(
                    "say what to classify: --input DIR, --synthetic N, or --worklist",
                ))
            }
        };
    // Inputs arrive on a channel, from the list or from stdin, with their files already read,
    // so results keep flowing while the producer waits for more work and file reads overlap the
    // preprocessing. Read buffers come back on `spent` to be reused.
    // A GPU producer takes a batch at a time: room for two.
    let ahead = if a.nvjpeg { 2 * a.batch.max(1) } else { 16 };
    let (tx, rx) = mpsc::sync_channel::<Item>(ahead);
    let (spent, reuse) = mpsc::channel::<Vec<u8>>();
    let fill = move |i: u64, s: Source| {
        let bytes = read_ahead(&s, reuse.try_recv().unwrap_or_default());
        (i, s, bytes)
    };
    match items {
        Some(list) => {
            std::thread::spawn(move || {
                for (i, s) in list {
                    if tx.send(fill(i, s)).is_err() {
                        break;
                    }
                }
            });
        }
        None => {
            std::thread::spawn(move || {
                for line in std::io::stdin().lock().lines() {
                    let Ok(line) = line else { break };
                    let Some((idx, src)) = line.split_once('\t') else {
                        tracing::warn!("ignoring worklist line without a tab: {line:?}");
                        continue;
                    };
                    let Ok(idx) = idx.trim().parse::<u64>() else {
                        tracing::warn!("ignoring worklist line with a bad index: {line:?}");
                        continue;
                    };
                    let src: Source = src.trim().parse().expect("infallible");
                    if tx.send(fill(idx, src)).is_err() {
                        break;
                    }
                }
            });
        }
    }
    Ok((rx, spent))
}

/// The line for input `index`, given the server's answer to it.
pub(crate) fn result_line(
    a: &Args,
    index: u64,
    input: String,
    t0: Instant,
    st: StageTimes,
    result: std::result::Result<Vec<u8>, tensorport::RemoteError>,
) -> ResultLine {
    let (scores, error) = match result {
        Ok(b) => match scores_from_bytes(&b) {
            Some(s) => (Some(s), None),
            None => (None, Some("the server sent a malformed result".to_string())),
        },
        Err(e) => (None, Some(e.to_string())),
    };
    ResultLine {
        index,
        input,
        class: scores.as_deref().and_then(argmax),
        scores,
        error,
        latency_ms: t0.elapsed().as_secs_f64() * 1e3,
        producer: a.name.clone(),
        stages: a.profile.then_some(st),
    }
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
