//! `tensorport farm`: the command-line face of `tensorport_farm::farm` — flags to a
//! `FarmConfig`, the console that shows its reports, the summary and the exit status.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tensorport_farm::config::{Device, LeftOpen, Machine, RunOptions, Servers};
use tensorport_farm::FarmConfig;
use tensorport_vision::Source;

use crate::common::{CliError, CliResult, HandOverArgs, ModelArgs};
use crate::view::Console;

/// When to draw live progress.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// On a terminal.
    Auto,
    /// Always (even into a file or pipe).
    Always,
    /// Never.
    Never,
}

/// Classify a set of images with one inference server and N producer processes. The farm starts
/// the server and the producers, hands inputs to producers as they have room, restarts a
/// producer (or the server) that dies — with back-off — and redoes its unfinished inputs, so
/// every input gets exactly one line in --output. Ctrl-C finishes the work in flight and stops;
/// a second Ctrl-C stops at once. Shows live progress on a terminal, stays quiet otherwise, and
/// ends with a summary.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Folder of PNG/JPEG images to classify.
    #[arg(long, conflicts_with_all = ["synthetic", "input_list"])]
    pub input: Option<PathBuf>,
    /// A file listing the images to classify, one path per line, in the order to hand them out
    /// (a path may come more than once: each line is an input). `-`: read them from standard
    /// input as they come, handing each out on arrival; the farm keeps its producers waiting
    /// for more and ends once standard input is closed and every input has its result.
    #[arg(long, value_name = "FILE", conflicts_with = "synthetic")]
    pub input_list: Option<PathBuf>,
    /// The --input-list's paths end with a NUL byte instead of a newline, as `find -print0`
    /// writes them: any file name round-trips, newlines in it included.
    #[arg(long, short = '0', requires = "input_list")]
    pub null: bool,
    /// Classify N generated images instead of files.
    #[arg(long, value_name = "N")]
    pub synthetic: Option<u64>,
    /// Number of producer processes preparing on the CPU [default: 3; with --device cuda and
    /// neither -p nor --gpu-producers given: one per core but two and one per GPU producer
    /// where nvJPEG loads (they share the plain JPEGs with the GPU producers, see --routing),
    /// else one per core but the server's].
    #[arg(long, short = 'p', value_name = "N")]
    pub producers: Option<usize>,
    /// Producers that decode and prepare on the GPU (`produce --nvjpeg`: batches of JPEGs
    /// decoded by nvJPEG, resized and normalised by a kernel, handed over in device memory),
    /// besides the --producers CPU ones; each works on its server's GPU. Needs --device cuda
    /// (or --devices) [default: 0; with --device cuda and neither -p nor --gpu-producers
    /// given: two per GPU where nvJPEG loads].
    #[arg(long, value_name = "N")]
    pub gpu_producers: Option<usize>,
    /// Inference servers, each with its own socket (and model); producers are spread over the
    /// ones that listen, the least loaded first. A server that dies has its producers' inputs
    /// redone through the others while it restarts.
    #[arg(long, default_value_t = 1, conflicts_with = "devices")]
    pub servers: usize,
    /// One server per listed GPU (e.g. `--devices 0,1`: a server on cuda:0 and one on cuda:1);
    /// overrides --device and --servers.
    #[arg(long, value_delimiter = ',', value_name = "GPU,...")]
    pub devices: Vec<u32>,
    /// Start no server: the producers feed the one already listening at SOCKET (a Python
    /// `tensorport.Loader`'s, say), which the farm never drains. The model options are then
    /// unused, except --image-size for the producers.
    #[arg(long, value_name = "SOCKET", conflicts_with_all = ["devices", "servers", "socket"])]
    pub attach: Option<PathBuf>,
    /// With --attach: the GPU the attached server's device memory is on (for --gpu-producers;
    /// with neither -p nor --gpu-producers, the farm then picks the GPU mix, as with --device
    /// cuda) [default: 0, and the CPU mix].
    #[arg(long, value_name = "ORDINAL", requires = "attach")]
    pub attach_gpu: Option<u32>,
    /// Where to write the results, one JSON line per input.
    #[arg(long, short, default_value = "results.jsonl")]
    pub output: PathBuf,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Requests each producer keeps in flight. The farm hands each producer up to twice as many
    /// inputs, so the next ones are ready; progress shows them as "handed out" [default: 8; 32
    /// with an ONNX model on a GPU, whose batches fill only with more outstanding].
    #[arg(long)]
    pub in_flight: Option<u32>,
    /// Requests each GPU producer keeps in flight: its device buffers on the GPU, 1 to 256
    /// (each buffer holds one image). The farm hands it up to twice as many inputs.
    #[arg(long, default_value_t = tensorport_farm::farm::DEFAULT_GPU_IN_FLIGHT)]
    pub gpu_in_flight: u32,
    /// Images each GPU producer decodes per nvJPEG batch, 1 to --gpu-in-flight [default: half
    /// of --gpu-in-flight, at most 64].
    #[arg(long)]
    pub gpu_batch: Option<u32>,
    /// Threads for the server's model [default: all cores].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Socket path [default: a fresh private directory, removed afterwards].
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Live progress: auto (on a terminal), always, never.
    #[arg(long, value_enum, default_value_t = Progress::Auto)]
    pub progress: Progress,
    /// A producer that holds inputs but returns no result for this many seconds, while the
    /// server runs, is taken as hung (stopped, deadlocked in its preprocessing): the farm kills
    /// it, restarts it and hands its inputs out again.
    #[arg(
        long,
        default_value_t = tensorport_farm::config::defaults::DEFAULT_STALL.as_secs_f64(),
        value_name = "SECONDS",
        value_parser = crate::common::parse_seconds
    )]
    pub stall_secs: f64,
    #[command(flatten)]
    pub hand_over: HandOverArgs,
    #[command(flatten)]
    pub run: RunOptions,
    /// Print the producers this farm would start, as `CPU GPU` (the automatic mix where neither
    /// -p nor --gpu-producers is given), and exit without starting anything.
    #[arg(long)]
    pub print_producers: bool,
    /// Log level of the server and producers (their stderr is shown prefixed with their name).
    #[arg(long, default_value = "warn", value_parser = crate::common::parse_log_filter)]
    pub child_log: String,
}

impl Args {
    /// The farm's configuration, with its inputs listed.
    pub fn config(&self) -> CliResult<FarmConfig> {
        let inputs: Vec<Source> = match (&self.input, &self.input_list, self.synthetic) {
            (Some(dir), _, _) => crate::common::list_inputs(dir)?
                .into_iter()
                .map(Source::File)
                .collect(),
            (None, Some(list), _) if list.as_os_str() == "-" => Vec::new(),
            (None, Some(list), _) => {
                let bytes = std::fs::read(list).map_err(|e| {
                    CliError::usage(format!("--input-list {}: {e}", list.display()))
                })?;
                split_list(&bytes, self.null).map(Source::File).collect()
            }
            (None, None, Some(n)) => (0..n).map(Source::Synthetic).collect(),
            (None, None, None) => {
                return Err(CliError::usage(
                    "say what to classify: --input DIR (PNG/JPEG files), --input-list FILE or \
                     --synthetic N",
                ))
            }
        };
        let servers = match &self.attach {
            Some(socket) => Servers::Attach {
                socket: socket.clone(),
                gpu: self.attach_gpu,
            },
            None if self.devices.is_empty() => Servers::Copies(self.servers),
            None => Servers::Gpus(self.devices.clone()),
        };
        let model = match self.devices.first() {
            Some(&gpu) => self.model.options_on(Device::Cuda(gpu)),
            None => self.model.options(),
        };
        let mut cfg = FarmConfig::new(inputs, servers, model, self.output.clone());
        cfg.producers = self.producers.unwrap_or(cfg.producers);
        cfg.gpu_producers = self.gpu_producers.unwrap_or(0);
        cfg.in_flight = self.in_flight.unwrap_or(cfg.in_flight);
        cfg.gpu_in_flight = self.gpu_in_flight;
        cfg.gpu_batch = self.gpu_batch.unwrap_or(cfg.gpu_batch);
        cfg.threads = self.threads;
        cfg.socket = self.socket.clone();
        cfg.stall = Duration::from_secs_f64(self.stall_secs);
        cfg.ready = self.hand_over.ready;
        cfg.prep = self.hand_over.prep_options();
        cfg.profile = self.hand_over.profile;
        cfg.keep = self.hand_over.keep();
        cfg.non_finite = self.hand_over.non_finite;
        cfg.child_log = self.child_log.clone();
        cfg.launcher = crate::launcher();
        cfg.run = self.run.clone();
        // What depends on the run and was not given, decided once, by the library.
        let open = LeftOpen {
            mix: self.producers.is_none() && self.gpu_producers.is_none(),
            in_flight: self.in_flight.is_none(),
            gpu_batch: self.gpu_batch.is_none(),
        };
        cfg.resolve_defaults(open, Machine::detect);
        Ok(cfg)
    }
}

pub fn run(args: Args) -> CliResult<u8> {
    let cfg = args.config()?;
    if args.print_producers {
        println!("{} {}", cfg.producers, cfg.gpu_producers);
        return Ok(0);
    }
    // Checked before the progress block appears.
    cfg.check().map_err(tensorport_farm::Error::from)?;
    let tty = match args.progress {
        Progress::Always => true,
        Progress::Never => false,
        Progress::Auto => std::io::stderr().is_terminal(),
    };
    let console = Arc::new(Console::new(tty, cfg.inputs.len() as u64));
    let streamed = args
        .input_list
        .as_ref()
        .is_some_and(|l| l.as_os_str() == "-");
    // A first SIGINT/SIGTERM drains the farm, a second ends it at once (the farm ends its
    // children and removes its socket directory itself).
    let stop = tensorport_farm::process::Stop::new();
    stop.on_signals(false)
        .map_err(|e| CliError::new(format!("cannot handle SIGINT/SIGTERM: {e}")))?;
    let outcome = match streamed {
        false => tensorport_farm::farm::run(cfg, console.clone(), &stop),
        true => tensorport_farm::farm::run_with(
            cfg,
            console.clone(),
            Some(stdin_inputs(args.null)),
            &stop,
        ),
    };
    console.clear();
    let outcome = outcome?;
    let Some(summary) = &outcome.summary else {
        console.log("stopped at once (second signal)");
        return Ok(130);
    };
    crate::view::print_summary(summary);
    if let Some(f) = outcome.failure {
        return Err(f.into());
    }
    if summary.done < summary.inputs {
        return Ok(if outcome.stopped { 130 } else { 1 });
    }
    Ok(0)
}

/// The paths of an input list: one per line, or with `null` each ending in a NUL byte; the
/// bytes of each as they are (non-UTF-8 names included). Empty entries (and, one per line,
/// blank ones) are skipped.
fn split_list(bytes: &[u8], null: bool) -> impl Iterator<Item = PathBuf> + '_ {
    use std::os::unix::ffi::OsStrExt;
    let sep = if null { b'\0' } else { b'\n' };
    bytes
        .split(move |&b| b == sep)
        .filter(move |p| match null {
            true => !p.is_empty(),
            false => !p.iter().all(u8::is_ascii_whitespace),
        })
        .map(|p| PathBuf::from(std::ffi::OsStr::from_bytes(p)))
}

/// The paths on standard input, as [`split_list`] reads them, sent as they come; the channel
/// closes with it.
fn stdin_inputs(null: bool) -> std::sync::mpsc::Receiver<Source> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        let sep = if null { b'\0' } else { b'\n' };
        for entry in std::io::stdin().lock().split(sep) {
            let Ok(entry) = entry else { break };
            let Some(path) = split_list(&entry, null).next() else {
                continue;
            };
            if tx.send(Source::File(path)).is_err() {
                break;
            }
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_lists_split_by_line_or_by_nul() {
        use std::os::unix::ffi::OsStrExt;
        let lines: Vec<PathBuf> = split_list(b"a.jpg\n\n  \nb c.png\n\xff.jpg", false).collect();
        assert_eq!(
            lines,
            [
                PathBuf::from("a.jpg"),
                PathBuf::from("b c.png"),
                PathBuf::from(std::ffi::OsStr::from_bytes(b"\xff.jpg")),
            ]
        );
        let nul: Vec<PathBuf> = split_list(b"x\ny.jpg\0\0 \0z.png\0", true).collect();
        assert_eq!(
            nul,
            [
                PathBuf::from("x\ny.jpg"),
                PathBuf::from(" "),
                PathBuf::from("z.png")
            ]
        );
    }
}
