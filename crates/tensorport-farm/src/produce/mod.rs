//! A producer: inputs from a [`Feed`], prepared into the server's shared memory (on the CPU) or
//! into device buffers (on the GPU), submitted, and answered with one result line each.
//!
//! Both loops share this skeleton: the requests outstanding ([`Outstanding`]), the refusal of
//! an input given again while in flight, the timeout on results, and the line writer. The
//! request id is the input's index, so a consumer knows which input it holds (a Python `Loader`
//! yields the indices with the batch).

mod cpu;
mod gpu;
mod lane;

pub use gpu::jpeg_job as gpu_jpeg_job;

use std::collections::HashMap;
use std::io::Write;
use std::time::{Duration, Instant};

use crate::config::{Output, ProduceConfig};
use crate::error::{ConfigError, Error, Result};
use crate::feed::{Feed, Input};
use crate::record::{LineWriter, Submitted};

/// Runs a producer until its inputs end; returns how many lines it wrote.
pub fn run(cfg: &ProduceConfig) -> Result<u64> {
    cfg.check()?;
    // A GPU producer takes a batch at a time: room for two.
    let ahead = match cfg.gpu {
        Some(g) => 2 * g.batch.max(1),
        None => 16,
    };
    let feed = Feed::start(&cfg.inputs, ahead, cfg.read_timeout)?;
    let out = open_output(&cfg.output)?;
    let mut lines = LineWriter::new(out, cfg.name.clone(), cfg.profile, cfg.keep, cfg.non_finite);
    match cfg.gpu {
        Some(g) => gpu::run(cfg, g, &feed, &mut lines)?,
        None => cpu::run(cfg, &feed, &mut lines)?,
    }
    tracing::info!(results = lines.written(), "producer done");
    Ok(lines.written())
}

/// `connect()` again, every 20 ms, while it fails because nothing listens at the socket yet
/// (`no_server`), for up to `wait`; any other failure, or the last, as it came.
fn connect_when_listening<T, E>(
    wait: Duration,
    mut connect: impl FnMut() -> std::result::Result<T, E>,
    no_server: impl Fn(&E) -> bool,
) -> std::result::Result<T, E> {
    let deadline = Instant::now() + wait;
    let mut logged = false;
    loop {
        match connect() {
            Err(e) if no_server(&e) && Instant::now() < deadline => {
                if !logged {
                    tracing::debug!("no server listens yet; waiting for it");
                    logged = true;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            done => return done,
        }
    }
}

/// Where the result lines go.
fn open_output(o: &Output) -> Result<Box<dyn Write>> {
    Ok(match o {
        Output::Stdout => Box::new(std::io::stdout().lock()),
        Output::File(path) => Box::new(std::io::BufWriter::new(
            std::fs::File::create(path).map_err(|source| ConfigError::Output {
                path: path.clone(),
                source,
            })?,
        )),
    })
}

/// The requests submitted and not answered yet, by request id (the input's index).
struct Outstanding {
    pending: HashMap<u64, Submitted>,
    timeout: Duration,
}

impl Outstanding {
    fn new(timeout: Duration) -> Outstanding {
        Outstanding {
            pending: HashMap::new(),
            timeout,
        }
    }

    fn len(&self) -> usize {
        self.pending.len()
    }

    fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    fn holds(&self, index: u64) -> bool {
        self.pending.contains_key(&index)
    }

    fn insert(&mut self, s: Submitted) {
        self.pending.insert(s.index, s);
    }

    /// Writes the line for a result (one for a request not outstanding is dropped).
    fn answer(&mut self, c: tensorport::Completion, lines: &mut LineWriter) -> Result<()> {
        if let Some(s) = self.pending.remove(&c.request_id) {
            lines.answered(s, c.result)?;
        }
        Ok(())
    }

    /// Fails once the oldest request has waited longer than the timeout.
    fn check_overdue(&self) -> Result<()> {
        match self.pending.values().map(|s| s.submitted).min() {
            Some(oldest) if oldest.elapsed() > self.timeout => {
                Err(Error::NoResult(self.timeout.as_secs()))
            }
            _ => Ok(()),
        }
    }
}

/// Refuses `input` if `held` says it is already in flight: its read buffer goes
/// back, and it gets an error line. Returns whether it was refused.
fn refuse_again(
    input: &mut Input,
    held: bool,
    feed: &Feed,
    lines: &mut LineWriter,
) -> Result<bool> {
    if !held {
        return Ok(false);
    }
    if let Some((Ok(buf), _)) = input.bytes.take() {
        feed.reuse(buf);
    }
    let why = format!("input {} was given again while in flight", input.index);
    lines.failed(input.index, &input.source, why, None, None)?;
    Ok(true)
}

/// A submitted input's record.
fn submitted(
    index: u64,
    source: &tensorport_vision::Source,
    taken: Instant,
    stages: crate::record::StageTimes,
) -> Submitted {
    Submitted {
        index,
        input: crate::record::InputName::of(source),
        taken,
        submitted: Instant::now(),
        stages,
    }
}
