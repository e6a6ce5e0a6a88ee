//! MPS for a run's GPU processes, decided and driven with real processes: stand-ins for
//! `nvidia-cuda-mps-control` (a daemon that detaches and answers on a control FIFO in its pipe
//! directory, as NVIDIA's did before CUDA 13, whose daemon listens on a Unix socket there: the
//! join test makes both) and `nvidia-smi` (a compute mode), written by the tests. What
//! the decision takes: a running daemon, none, a GPU whose compute mode refuses MPS, a daemon
//! that will not start, one that dies during the run.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tensorport_farm::mps::{daemon_at, Mps, MpsMode, Plan, Tools, LOG_ENV, PIPE_ENV};

/// The control program's stand-in: `-d` makes the control FIFO and detaches a process that
/// lives while it is there (the daemon, which keeps the standard error it inherited open) and
/// writes its pid where NVIDIA's does;
/// otherwise it reads a command: `quit` removes the FIFO (the daemon ends), `get_server_list`
/// answers. With `fail`, `-d` fails.
fn control_script(dir: &Path, fail: bool) -> PathBuf {
    let path = dir.join(if fail {
        "control-fails"
    } else {
        "nvidia-cuda-mps-control"
    });
    let start = if fail {
        "echo 'An instance of this daemon is already running' >&2; exit 1"
    } else {
        r#"mkfifo "$pipe/control" || exit 1
    setsid bash -c 'while [ -p "$0/control" ]; do sleep 0.05; done' "$pipe" </dev/null >/dev/null &
    echo $! > "$pipe/nvidia-cuda-mps-control.pid"
    echo "started" >> "$CUDA_MPS_LOG_DIRECTORY/control.log"
    exit 0"#
    };
    let script = format!(
        r#"#!/bin/bash
pipe="${{CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}}"
if [ "$1" = "-d" ]; then
    {start}
fi
[ -p "$pipe/control" ] || exit 1
read -r cmd
case "$cmd" in
    quit) rm -f "$pipe/control"; exit 0 ;;
    get_server_list) exit 0 ;;
    *) exit 1 ;;
esac
"#
    );
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// `nvidia-smi`'s stand-in: GPU 0 in compute mode `mode`.
fn smi_script(dir: &Path, mode: &str) -> PathBuf {
    let path = dir.join(format!("smi-{mode}"));
    std::fs::write(&path, format!("#!/bin/bash\necho '0, {mode}'\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

struct Machine {
    dir: tempfile::TempDir,
    /// Where a system daemon would keep its pipes.
    system: PathBuf,
}

impl Machine {
    fn new() -> Machine {
        let dir = tempfile::tempdir().unwrap();
        let system = dir.path().join("nvidia-mps");
        std::fs::create_dir(&system).unwrap();
        Machine { dir, system }
    }

    fn tools(&self, control: bool, fail: bool, mode: &str) -> Tools {
        Tools {
            control: control.then(|| control_script(self.dir.path(), fail)),
            smi: Some(smi_script(self.dir.path(), mode)),
            system_pipe: self.system.clone(),
        }
    }
}

fn env_of(m: &Mps, key: &str) -> Option<PathBuf> {
    m.env()
        .into_iter()
        .find(|(k, _)| *k == key)
        .map(|(_, v)| PathBuf::from(v))
}

/// `auto` with no daemon running starts a private one in a folder of its own, hands its pipe
/// and log folders to the run's processes, and quits it when the run is over.
#[test]
fn auto_without_a_daemon_starts_a_private_one_and_quits_it_at_the_end() {
    let m = Machine::new();
    let mps = Mps::start(MpsMode::Auto, &m.tools(true, false, "Default"), &[0]).unwrap();
    assert_eq!(mps.plan(), &Plan::Start);
    let pipe = env_of(&mps, PIPE_ENV).expect("the pipe folder for the children");
    let log = env_of(&mps, LOG_ENV).expect("the log folder for the children");
    assert!(daemon_at(&pipe), "no control pipe in {}", pipe.display());
    assert_ne!(
        pipe, m.system,
        "the private daemon uses a folder of its own"
    );
    assert!(std::fs::read_to_string(log.join("control.log")).is_ok());
    assert!(
        mps.describe().contains("private MPS daemon"),
        "{}",
        mps.describe()
    );
    // Nothing else on the machine sees the folder.
    let mode = std::fs::metadata(pipe.parent().unwrap())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o077, 0, "{mode:o}");
    drop(mps);
    assert!(!daemon_at(&pipe), "the daemon was not quit");
    assert!(!pipe.exists(), "its folder was left behind");
}

/// `auto` with a daemon running at the system pipe folder joins it as it is: no second
/// daemon, and that folder for the run's processes. The daemon's control endpoint is a Unix
/// socket (CUDA 13's daemon) or a FIFO (older ones').
#[test]
fn auto_with_a_daemon_running_joins_it() {
    for socket in [true, false] {
        let m = Machine::new();
        let control = m.system.join("control");
        let _listening = match socket {
            true => Some(std::os::unix::net::UnixListener::bind(&control).unwrap()),
            false => {
                nix::unistd::mkfifo(&control, nix::sys::stat::Mode::S_IRWXU).unwrap();
                None
            }
        };
        let mps = Mps::start(MpsMode::Auto, &m.tools(true, false, "Default"), &[0]).unwrap();
        assert_eq!(mps.plan(), &Plan::Join, "socket: {socket}");
        assert_eq!(env_of(&mps, PIPE_ENV), Some(m.system.clone()));
        assert!(mps.describe().contains(&m.system.display().to_string()));
        drop(mps);
        assert!(
            daemon_at(&m.system),
            "a daemon that was not the run's own was quit"
        );
    }
}

/// A GPU whose compute mode refuses MPS, no control program, or a daemon that will not start:
/// `auto` goes on without MPS and says why; `on` refuses to start; `off` never asks.
#[test]
fn where_mps_cannot_be_had_auto_goes_without_and_on_refuses() {
    let m = Machine::new();
    let cases = [
        (
            m.tools(true, false, "Prohibited"),
            "compute mode is Prohibited",
        ),
        (
            m.tools(false, false, "Default"),
            "nvidia-cuda-mps-control is not on PATH",
        ),
        (m.tools(true, true, "Default"), "already running"),
    ];
    for (tools, why) in &cases {
        let mps = Mps::start(MpsMode::Auto, tools, &[0]).unwrap();
        assert!(
            mps.why_off().is_some_and(|w| w.contains(why)),
            "{why}: {:?}",
            mps.plan()
        );
        assert!(mps.env().is_empty());
        assert!(mps.describe().contains("without MPS"), "{}", mps.describe());
        let e = Mps::start(MpsMode::On, tools, &[0])
            .unwrap_err()
            .to_string();
        assert!(e.contains("MPS cannot be had") && e.contains(why), "{e}");
    }
    let mps = Mps::start(MpsMode::Off, &m.tools(true, false, "Default"), &[0]).unwrap();
    assert_eq!(mps.plan(), &Plan::Off { why: None });
    assert!(mps.env().is_empty());
    // A compute mode that refuses MPS on a GPU the run does not use is no reason.
    let mps = Mps::start(MpsMode::Auto, &m.tools(true, false, "Prohibited"), &[1]).unwrap();
    assert_eq!(mps.plan(), &Plan::Start);
}

/// The private daemon dies during the run: `revive` starts it again in the same folder (the
/// run's processes keep their variables) and says so; while it answers, nothing is done.
#[test]
fn a_private_daemon_that_dies_is_started_again() {
    let m = Machine::new();
    let mut mps = Mps::start(MpsMode::Auto, &m.tools(true, false, "Default"), &[0]).unwrap();
    let pipe = env_of(&mps, PIPE_ENV).unwrap();
    assert_eq!(mps.revive(), None);
    // The daemon ends (its control pipe goes with it).
    std::fs::remove_file(pipe.join("control")).unwrap();
    let t = Instant::now();
    let said = loop {
        if let Some(s) = mps.revive() {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the death was not seen"
        );
    };
    assert!(said.contains("started again"), "{said}");
    assert!(daemon_at(&pipe));
    assert_eq!(env_of(&mps, PIPE_ENV), Some(pipe.clone()));
    assert_eq!(mps.revive(), None);
    drop(mps);
    assert!(!pipe.exists());
}

/// A process that is itself a client quits its private daemon as it exits without waiting for
/// it: the daemon is asked to quit, and its folder is removed once it has.
#[test]
fn quitting_at_exit_leaves_nothing_behind() {
    let m = Machine::new();
    let mps = Mps::start(MpsMode::Auto, &m.tools(true, false, "Default"), &[0]).unwrap();
    let pipe = env_of(&mps, PIPE_ENV).unwrap();
    let folder = pipe.parent().unwrap().to_owned();
    mps.quit_at_exit();
    // A watchdog, not a timing: the helper removes the folder once the daemon has gone.
    let t = Instant::now();
    while folder.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{} is still there",
            folder.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A daemon that leaves its control endpoint behind as it ends is seen to end by its process
/// (the pid file it keeps in its pipe folder): the run waits for that, and its folder goes.
#[test]
fn a_daemon_that_leaves_its_endpoint_behind_is_seen_to_end_by_its_process() {
    let m = Machine::new();
    let control = m.dir.path().join("control-leaves-its-endpoint");
    let script = r#"#!/bin/bash
pipe="${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}"
if [ "$1" = "-d" ]; then
    mkfifo "$pipe/control" || exit 1
    setsid bash -c 'while [ ! -e "$0/quitting" ]; do sleep 0.05; done' "$pipe" </dev/null >/dev/null &
    echo $! > "$pipe/nvidia-cuda-mps-control.pid"
    exit 0
fi
read -r cmd
case "$cmd" in
    quit) touch "$pipe/quitting"; exit 0 ;;
    get_server_list) exit 0 ;;
    *) exit 1 ;;
esac
"#;
    std::fs::write(&control, script).unwrap();
    std::fs::set_permissions(&control, std::fs::Permissions::from_mode(0o755)).unwrap();
    let tools = Tools {
        control: Some(control),
        ..m.tools(true, false, "Default")
    };
    let mps = Mps::start(MpsMode::Auto, &tools, &[0]).unwrap();
    let pipe = env_of(&mps, PIPE_ENV).unwrap();
    let pid: i32 = std::fs::read_to_string(pipe.join("nvidia-cuda-mps-control.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // Running: there and not a zombie (the machine's first process reaps what it inherits
    // when it gets to it).
    let running = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|s| !s.rsplit_once(')').unwrap().1.trim_start().starts_with('Z'))
    };
    assert!(running(), "the daemon runs");
    drop(mps);
    assert!(!running(), "the daemon was not waited for");
    assert!(!pipe.exists(), "its folder was left behind");
}
