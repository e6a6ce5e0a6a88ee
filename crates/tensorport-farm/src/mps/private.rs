//! A private MPS control daemon: started with pipe and log folders of its own, asked whether it
//! still answers, and quit (at once, or in the background for a process that is its client).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::control::{daemon_at, LOG_ENV, PIPE_ENV};

/// The file in its pipe folder where the control daemon writes its process id.
const PID_FILE: &str = "nvidia-cuda-mps-control.pid";

/// A private control daemon: its folder (pipes and log) and how to reach it.
#[derive(Debug)]
pub(super) struct Private {
    control: PathBuf,
    dir: tempfile::TempDir,
}

impl Private {
    pub(super) fn pipe(&self) -> PathBuf {
        self.dir.path().join("pipe")
    }

    pub(super) fn log(&self) -> PathBuf {
        self.dir.path().join("log")
    }

    fn control(&self) -> Command {
        let mut c = Command::new(&self.control);
        c.env(PIPE_ENV, self.pipe())
            .env(LOG_ENV, self.log())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        c
    }

    /// Starts the daemon (`-d`: it detaches) and waits up to 10 s for its control pipe.
    pub(super) fn start(control: &Path) -> Result<Private, String> {
        let dir = tempfile::Builder::new()
            .prefix("tp-mps-")
            .tempdir()
            .map_err(|e| format!("cannot make a folder for a private MPS daemon: {e}"))?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700))
                .map_err(|e| format!("{}: {e}", dir.path().display()))?;
        }
        let p = Private {
            control: control.to_owned(),
            dir,
        };
        for d in [p.pipe(), p.log()] {
            std::fs::create_dir(&d).map_err(|e| format!("{}: {e}", d.display()))?;
        }
        p.launch()?;
        Ok(p)
    }

    pub(super) fn launch(&self) -> Result<(), String> {
        // Its messages go to a file: the daemon it leaves behind may keep what it inherited
        // open, so a pipe would never see its end.
        let said = self.log().join("tensorport-start.txt");
        let err = std::fs::File::create(&said).map_err(|e| format!("{}: {e}", said.display()))?;
        let status = self
            .control()
            .arg("-d")
            .stderr(err)
            .status()
            .map_err(|e| format!("{}: {e}", self.control.display()))?;
        if !status.success() {
            let text = std::fs::read_to_string(&said).unwrap_or_default();
            return Err(format!(
                "{} -d failed ({status}): {}",
                self.control.display(),
                text.trim()
            ));
        }
        let t = Instant::now();
        while !daemon_at(&self.pipe()) {
            if t.elapsed() > Duration::from_secs(10) {
                return Err(format!(
                    "{} -d started no daemon within 10 s (no control pipe in {})",
                    self.control.display(),
                    self.pipe().display()
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    /// The daemon's process, from the file it keeps in its pipe folder.
    fn pid(&self) -> Option<nix::unistd::Pid> {
        let text = std::fs::read_to_string(self.pipe().join(PID_FILE)).ok()?;
        let pid: i32 = text.trim().parse().ok()?;
        (pid > 0).then(|| nix::unistd::Pid::from_raw(pid))
    }

    /// Whether the daemon has ended: its process is gone or a zombie (where its pid file names
    /// one; a daemon may leave its control socket behind, and a container's first process may
    /// be slow to reap what it inherits), else its control endpoint.
    fn ended(&self, pid: Option<nix::unistd::Pid>) -> bool {
        match pid {
            Some(p) => !running(p),
            None => !daemon_at(&self.pipe()),
        }
    }

    /// Whether the daemon still answers: its control pipe is there and a `quit`-less query
    /// (`get_server_list`) succeeds within 5 s.
    pub(super) fn alive(&self) -> bool {
        if !daemon_at(&self.pipe()) {
            return false;
        }
        ask(self.control(), "get_server_list\n", Duration::from_secs(5))
    }
}

/// Whether process `pid` exists and is not a zombie.
fn running(pid: nix::unistd::Pid) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which ends with the line's last ')'.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => nix::sys::signal::kill(pid, None).is_ok(),
    }
}

/// Runs `cmd` with `line` on its standard input; whether it succeeded within `limit` (killed
/// past it).
fn ask(mut cmd: Command, line: &str, limit: Duration) -> bool {
    use std::io::Write;
    let Ok(mut child) = cmd.stdin(Stdio::piped()).stderr(Stdio::null()).spawn() else {
        return false;
    };
    if let Some(mut i) = child.stdin.take() {
        let _ = i.write_all(line.as_bytes());
    }
    let t = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(s)) => return s.success(),
            Ok(None) if t.elapsed() < limit => std::thread::sleep(Duration::from_millis(5)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return false;
            }
        }
    }
}

impl Private {
    /// Asks the daemon to quit without waiting for it, for a process that is itself one of its
    /// clients and ending: the daemon ends after its last client, and a detached helper removes
    /// its folder once it has (or after a minute).
    pub(super) fn quit_in_background(self) {
        let pid = self.pid().map_or(String::new(), |p| p.to_string());
        ask(self.control(), "quit\n", Duration::from_secs(10));
        let dir = self.dir.path().to_owned();
        let pipe = self.pipe();
        // The folder outlives this process: the helper removes it.
        let _ = std::mem::ManuallyDrop::new(self);
        // Gone: its process (or a zombie, where its pid file named one), else its control
        // endpoint.
        let script = r#"for _ in $(seq 600); do
                if [ -n "$3" ]; then
                    s=$(cat "/proc/$3/stat" 2>/dev/null) || break
                    s=${s##*) }; [ "${s%% *}" = Z ] && break
                else
                    [ -p "$1/control" ] || [ -S "$1/control" ] || break
                fi
                sleep 0.1
            done
            rm -rf "$2""#;
        let _ = Command::new("sh")
            .args(["-c", script, "sh"])
            .arg(&pipe)
            .arg(&dir)
            .arg(pid)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn();
    }
}

impl Drop for Private {
    /// Quits the daemon (its MPS server ends with its last client) and waits, up to 5 s, for
    /// it to end.
    fn drop(&mut self) {
        let pid = self.pid();
        ask(self.control(), "quit\n", Duration::from_secs(10));
        let t = Instant::now();
        while !self.ended(pid) && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}
