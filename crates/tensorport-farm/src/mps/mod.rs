//! One GPU, many processes: CUDA's Multi-Process Service (MPS) for a run's GPU processes.
//!
//! Each process that uses a GPU has a CUDA context of its own, and the GPU runs one context at
//! a time: a GPU producer's decode and the server's network take turns (time slices), never
//! overlap. Clients of one MPS server share one context on the GPU, so their kernels run side by
//! side as if one process had launched them all. A CUDA process joins the MPS control daemon
//! whose pipe directory `CUDA_MPS_PIPE_DIRECTORY` names (default `/tmp/nvidia-mps`) when CUDA
//! starts in it; where none answers, it runs on its own, as without MPS.
//!
//! [`Mps::start`] decides, once per run ([`plan`], pure and unit-tested):
//! - `off`: nothing; the processes run as they would.
//! - `auto` (the default): a control daemon already serving the default pipe directory is
//!   joined as it is; otherwise a private one is started with pipe and log directories of its
//!   own (a fresh 0700 folder under the temporary directory: nothing else on the machine joins
//!   it), and quit when the run ends. Where MPS cannot be had — no control program, a GPU in
//!   the `Prohibited` compute mode, a daemon that will not start — the run goes on without it,
//!   saying why once.
//! - `on`: the same, but where MPS cannot be had the run does not start.
//!
//! The run's GPU processes get [`Mps::env`] in their environment. What MPS changes: a fatal
//! GPU fault in one client (an illegal address, say) can end the MPS server's work for every
//! client with work on the GPU at that moment, so the run must restart its GPU processes;
//! [`Mps::revive`] starts a private daemon again if it died.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

mod control;
mod private;
pub use control::{daemon_at, DEFAULT_PIPE_DIR, LOG_ENV, PIPE_ENV};
use private::Private;

/// Whether a run's GPU processes share the GPU through MPS.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum MpsMode {
    /// Join a running daemon, else start a private one; without MPS where it cannot be had.
    #[default]
    Auto,
    /// As `auto`, but the run does not start where MPS cannot be had.
    On,
    /// Each process with its own context (they time-slice the GPU).
    Off,
}

impl MpsMode {
    pub fn name(self) -> &'static str {
        match self {
            MpsMode::Auto => "auto",
            MpsMode::On => "on",
            MpsMode::Off => "off",
        }
    }
}

/// The programs MPS is driven with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tools {
    /// `nvidia-cuda-mps-control`, where found.
    pub control: Option<PathBuf>,
    /// `nvidia-smi`, where found (to read the GPUs' compute mode).
    pub smi: Option<PathBuf>,
    /// The pipe directory a running system daemon would use ([`PIPE_ENV`] as this process has
    /// it, else [`DEFAULT_PIPE_DIR`]).
    pub system_pipe: PathBuf,
}

impl Tools {
    /// The programs on `PATH`, and the system daemon's pipe directory.
    pub fn find() -> Tools {
        let on_path = |name: &str| {
            std::env::var_os("PATH").and_then(|p| {
                std::env::split_paths(&p)
                    .map(|d| d.join(name))
                    .find(|f| f.is_file())
            })
        };
        Tools {
            control: on_path("nvidia-cuda-mps-control"),
            smi: on_path("nvidia-smi"),
            system_pipe: std::env::var_os(PIPE_ENV)
                .filter(|p| !p.is_empty())
                .map_or_else(|| PathBuf::from(DEFAULT_PIPE_DIR), PathBuf::from),
        }
    }
}

/// What the machine offers, as far as the decision goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// The control program is there.
    pub control: bool,
    /// A control daemon answers at the system pipe directory.
    pub running: bool,
    /// A GPU of the run whose compute mode refuses MPS, with that mode.
    pub refused: Option<(u32, String)>,
}

/// What a run does about MPS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Nothing; `why` says why, where MPS was asked for (`auto`) and cannot be had.
    Off { why: Option<String> },
    /// Join the daemon already running at the system pipe directory.
    Join,
    /// Start a private daemon.
    Start,
}

/// The decision for `mode` on a machine as `probe` found it; `Err` where `on` cannot be met.
pub fn plan(mode: MpsMode, probe: &Probe) -> Result<Plan, String> {
    let why = match (mode, probe) {
        (MpsMode::Off, _) => return Ok(Plan::Off { why: None }),
        (
            _,
            Probe {
                refused: Some((gpu, m)),
                ..
            },
        ) => {
            format!("GPU {gpu}'s compute mode is {m}, which refuses MPS")
        }
        (_, Probe { running: true, .. }) => return Ok(Plan::Join),
        (_, Probe { control: false, .. }) => {
            "nvidia-cuda-mps-control is not on PATH (it comes with NVIDIA's driver)".into()
        }
        _ => return Ok(Plan::Start),
    };
    match mode {
        MpsMode::On => Err(why),
        _ => Ok(Plan::Off { why: Some(why) }),
    }
}

/// The compute mode of each GPU `nvidia-smi` lists: `(ordinal, mode)`; none where it does not
/// answer within 10 s.
fn compute_modes(smi: &Path) -> Vec<(u32, String)> {
    use std::io::Read;
    let Ok(mut child) = Command::new(smi)
        .args(["--query-gpu=index,compute_mode", "--format=csv,noheader"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
    else {
        return Vec::new();
    };
    let t = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if t.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(5))
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Vec::new();
            }
        }
    }
    let mut out = Vec::new();
    if let Some(mut stdout) = child.stdout.take() {
        let _ = stdout.read_to_end(&mut out);
    }
    String::from_utf8_lossy(&out)
        .lines()
        .filter_map(|l| {
            let (i, m) = l.split_once(',')?;
            Some((i.trim().parse().ok()?, m.trim().to_string()))
        })
        .collect()
}

/// Looks at the machine for a run on `gpus`.
pub fn probe(tools: &Tools, gpus: &[u32]) -> Probe {
    let refused = tools.smi.as_deref().and_then(|smi| {
        compute_modes(smi)
            .into_iter()
            .find(|(i, m)| gpus.contains(i) && m.eq_ignore_ascii_case("prohibited"))
    });
    Probe {
        control: tools.control.is_some(),
        running: daemon_at(&tools.system_pipe),
        refused,
    }
}

/// MPS for one run.
#[derive(Debug)]
pub struct Mps {
    plan: Plan,
    private: Option<Private>,
    /// Where the run's GPU processes' MPS pipes are, if they use MPS.
    pipe: Option<PathBuf>,
    log: Option<PathBuf>,
}

impl Mps {
    /// Nothing: the processes run as they would.
    pub fn off() -> Mps {
        Mps {
            plan: Plan::Off { why: None },
            private: None,
            pipe: None,
            log: None,
        }
    }

    /// Decides and does what `mode` asks for a run on `gpus`, with `tools`. `Err` only where
    /// `on` cannot be met; with `auto`, a daemon that will not start leaves the run without
    /// MPS ([`Mps::why_off`] says why).
    pub fn start(mode: MpsMode, tools: &Tools, gpus: &[u32]) -> Result<Mps, ConfigError> {
        let refuse = |why: String| ConfigError::Mps(why);
        match plan(mode, &probe(tools, gpus)).map_err(refuse)? {
            Plan::Off { why } => Ok(Mps {
                plan: Plan::Off { why },
                ..Mps::off()
            }),
            Plan::Join => Ok(Mps {
                plan: Plan::Join,
                private: None,
                pipe: Some(tools.system_pipe.clone()),
                log: None,
            }),
            Plan::Start => {
                let control = tools
                    .control
                    .as_deref()
                    .expect("planned with a control program");
                match Private::start(control) {
                    Ok(p) => Ok(Mps {
                        plan: Plan::Start,
                        pipe: Some(p.pipe()),
                        log: Some(p.log()),
                        private: Some(p),
                    }),
                    Err(why) if mode == MpsMode::On => Err(refuse(why)),
                    Err(why) => Ok(Mps {
                        plan: Plan::Off { why: Some(why) },
                        ..Mps::off()
                    }),
                }
            }
        }
    }

    /// What was decided.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Why the run goes without MPS where `auto` asked for it.
    pub fn why_off(&self) -> Option<&str> {
        match &self.plan {
            Plan::Off { why } => why.as_deref(),
            _ => None,
        }
    }

    /// One line for the run's log: how its GPU processes share the GPU.
    pub fn describe(&self) -> String {
        match (&self.plan, &self.pipe) {
            (Plan::Off { why: Some(why) }, _) => {
                format!("GPU processes without MPS (they take turns on the GPU): {why}")
            }
            (Plan::Off { why: None }, _) => "GPU processes without MPS (--mps off)".into(),
            (Plan::Join, Some(p)) => format!(
                "GPU processes share the GPU through the MPS daemon at {}",
                p.display()
            ),
            (_, Some(p)) => format!(
                "GPU processes share the GPU through a private MPS daemon ({})",
                p.display()
            ),
            (_, None) => "GPU processes without MPS".into(),
        }
    }

    /// The variables a GPU process of the run gets (none without MPS).
    pub fn env(&self) -> Vec<(&'static str, OsString)> {
        let mut v = Vec::new();
        if let Some(p) = &self.pipe {
            v.push((PIPE_ENV, p.clone().into_os_string()));
        }
        if let Some(l) = &self.log {
            v.push((LOG_ENV, l.clone().into_os_string()));
        }
        v
    }

    /// Ends MPS for a process that is itself a client of the daemon (a Python process whose
    /// model runs beside its `Loader`'s GPU producers) as it exits: a private daemon is asked
    /// to quit and ends after its last client; its folder is removed once it has.
    pub fn quit_at_exit(mut self) {
        if let Some(p) = self.private.take() {
            p.quit_in_background();
        }
    }

    /// Starts the private daemon again if it no longer answers; says so. `None` when it
    /// answers, or there is none of this run's own.
    pub fn revive(&mut self) -> Option<String> {
        let p = self.private.as_ref()?;
        if p.alive() {
            return None;
        }
        Some(match p.launch() {
            Ok(()) => "the private MPS daemon had ended: started again".into(),
            Err(e) => format!("the private MPS daemon had ended and did not start again: {e}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(control: bool, running: bool, refused: Option<&str>) -> Probe {
        Probe {
            control,
            running,
            refused: refused.map(|m| (0, m.to_string())),
        }
    }

    #[test]
    fn the_plan_follows_the_mode_and_what_the_machine_offers() {
        use MpsMode::*;
        let off = |p: Result<Plan, String>| match p {
            Ok(Plan::Off { why }) => why,
            other => panic!("{other:?}"),
        };
        // off: nothing, whatever there is.
        assert_eq!(off(plan(Off, &probe(true, true, None))), None);
        // A running daemon is joined; otherwise a private one started.
        assert_eq!(plan(Auto, &probe(true, true, None)), Ok(Plan::Join));
        assert_eq!(plan(On, &probe(false, true, None)), Ok(Plan::Join));
        assert_eq!(plan(Auto, &probe(true, false, None)), Ok(Plan::Start));
        // Without the control program: auto goes without, saying why; on refuses.
        let why = off(plan(Auto, &probe(false, false, None))).unwrap();
        assert!(why.contains("nvidia-cuda-mps-control"), "{why}");
        assert!(plan(On, &probe(false, false, None)).is_err());
        // A prohibited compute mode wins over a running daemon.
        let why = off(plan(Auto, &probe(true, true, Some("Prohibited")))).unwrap();
        assert!(why.contains("GPU 0's compute mode is Prohibited"), "{why}");
        assert!(plan(On, &probe(true, false, Some("Prohibited")))
            .unwrap_err()
            .contains("refuses MPS"));
    }
}
