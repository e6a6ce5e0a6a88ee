//! A NIXL stream's reads in a process of their own. NIXL and UCX take a producer's metadata as
//! it comes, and UCX checks some of it with assertions that abort the process they run in (a
//! worker address with a wrong version byte does); its metadata also names where UCX connects.
//! So the gateway never loads a peer's metadata itself: each host NIXL stream gets a reader
//! process (`tensorport-bridge nixl-reader`, this executable) that maps only the one pool it
//! reads into — the stream's own session's — loads the metadata, and reads the producer's slots
//! into that pool's slots on the gateway's word. If it dies, that stream's reads fail and the
//! stream ends; the gateway and every other stream go on. It connects only to the address the
//! producer's stream came from (`--connect-only`; the executable's `connect` enforces it, since
//! the metadata names where UCX connects).
//!
//! The protocol, text lines on the reader's standard input and output:
//! - the gateway sends the set-up ([`Hello::to_json`]) first, then `R <from> <into>` for each
//!   read (the producer's slot `from` into the pool's slot `into`, whose loan the gateway holds
//!   until the read's answer, or the reader's end);
//! - the reader answers `OK` once the metadata is loaded and the pool registered (or
//!   `E <why>` and ends), then `D <into>` for each read that has landed and `F <into> <why>` for
//!   each that failed.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::IpAddr;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorport::{HostPool, Loan};

use crate::nixl_setup::Hello;

/// The environment variable naming the `tensorport-bridge` executable whose `nixl-reader`
/// subcommand reads a stream [default: this process's executable].
pub const BRIDGE_EXE_ENV: &str = "TENSORPORT_BRIDGE_EXE";

/// The longest line a reader says (an answer with NIXL's reason for a failed read).
const MAX_LINE: usize = 4096;

/// Answers that may wait unread: more than one per slot a read is under way into is a reader
/// that does not keep the protocol, and waits on a full channel until the gateway ends it.
const MAX_ANSWERS: usize = 1024;

/// How long the reader has to load the metadata and register the pool.
const SET_UP: Duration = Duration::from_secs(30);

/// What the reader said.
enum Said {
    Ready,
    Done(u32),
    Failed(u32, String),
    /// It ended (or said something that is not the protocol): why.
    Gone(String),
}

/// The gateway's side: the reader process and the loans of the slots it reads into.
pub struct ReaderProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    said: mpsc::Receiver<Said>,
    /// Per pool slot: the loan of a read under way.
    landing: HashMap<u32, Loan>,
    /// Reads that have answered and not been asked for yet.
    answered: HashMap<u32, Result<(), String>>,
    /// Why the reader is gone, once it is.
    gone: Option<String>,
    slots: u32,
}

impl ReaderProcess {
    /// Starts a reader of `hello`'s slots into `pool` (NIXL agent `name`), which may connect
    /// to `peer` alone, and waits for its set-up; an error says why it could not (the reader's
    /// own words, or how it ended).
    pub fn start(
        hello: &Hello,
        name: &str,
        pool: &Arc<HostPool>,
        peer: IpAddr,
    ) -> Result<ReaderProcess, String> {
        // This executable, which has the subcommand; a program that embeds the gateway names
        // a `tensorport-bridge` executable in TENSORPORT_BRIDGE_EXE.
        let exe = match std::env::var_os(BRIDGE_EXE_ENV) {
            Some(p) => std::path::PathBuf::from(p),
            None => std::env::current_exe().map_err(|e| format!("this executable: {e}"))?,
        };
        let fd_path = format!("/proc/{}/fd/{}", std::process::id(), pool.raw_fd());
        let mut child = Command::new(exe)
            .args([
                "--log",
                "error",
                "nixl-reader",
                "--pool",
                &fd_path,
                "--name",
                name,
            ])
            .args(["--slots", &pool.slot_count().to_string()])
            .args(["--slot-size", &pool.slot_size().to_string()])
            .args(["--connect-only", &peer.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start the NIXL reader process: {e}"))?;
        let mut stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        // At most one answer per read the gateway asked for is ever waiting, so a bounded
        // channel is enough; a line longer than any answer ends the reader.
        let (tx, said) = mpsc::sync_channel(MAX_ANSWERS);
        std::thread::spawn(move || {
            let mut out = BufReader::new(stdout);
            let mut line = Vec::new();
            loop {
                line.clear();
                let n = (&mut out)
                    .take(MAX_LINE as u64 + 1)
                    .read_until(b'\n', &mut line);
                let s = match n {
                    Ok(0) | Err(_) => Said::Gone("it ended".into()),
                    Ok(_) if line.last() != Some(&b'\n') => {
                        Said::Gone(format!("it said a line of over {MAX_LINE} bytes"))
                    }
                    Ok(_) => parse(String::from_utf8_lossy(&line).trim_end()),
                };
                let stop = matches!(s, Said::Gone(_));
                if tx.send(s).is_err() || stop {
                    return;
                }
            }
        });
        let mut r = ReaderProcess {
            slots: hello.slots.slots,
            child,
            said,
            landing: HashMap::new(),
            answered: HashMap::new(),
            gone: None,
            stdin: {
                writeln!(stdin, "{}", hello.to_json())
                    .and_then(|()| stdin.flush())
                    .map_err(|e| format!("the NIXL reader process: {e}"))?;
                Some(stdin)
            },
        };
        match r.said.recv_timeout(SET_UP) {
            Ok(Said::Ready) => Ok(r),
            Ok(Said::Gone(why)) => Err(r.ended(why)),
            Ok(_) => Err(r.ended("it answered before its set-up".into())),
            Err(_) => Err(r.ended(format!("no set-up within {} s", SET_UP.as_secs()))),
        }
    }

    /// The producer's slots.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Why the reader failed, with how its process ended; the process is ended.
    fn ended(&mut self, why: String) -> String {
        let _ = self.child.kill();
        let status = self
            .child
            .wait()
            .map(|s| s.to_string())
            .unwrap_or_else(|e| e.to_string());
        format!("the NIXL reader process failed ({why}; {status})")
    }

    /// Starts reading the producer's slot `from` into `loan`'s pool slot; returns that slot.
    pub fn start_read(&mut self, from: u32, loan: Loan) -> Result<u32, String> {
        if let Some(why) = &self.gone {
            return Err(why.clone());
        }
        let into = loan.slot().slot;
        if from >= self.slots {
            return Err(format!("no slot {from} in the producer's set-up"));
        }
        let sent = match self.stdin.as_mut() {
            Some(stdin) => writeln!(stdin, "R {from} {into}").and_then(|()| stdin.flush()),
            None => Err(std::io::ErrorKind::BrokenPipe.into()),
        };
        if sent.is_err() {
            let why = self.drain_gone();
            return Err(why);
        }
        self.landing.insert(into, loan);
        Ok(into)
    }

    /// Takes what the reader has said, without waiting (or waiting up to `wait`).
    fn take(&mut self, wait: Option<Duration>) {
        let mut next = match wait {
            Some(t) => self.said.recv_timeout(t).ok(),
            None => self.said.try_recv().ok(),
        };
        while let Some(s) = next {
            // An answer for a slot no read is under way into breaks the protocol.
            let s = match s {
                Said::Done(into) | Said::Failed(into, _) if !self.landing.contains_key(&into) => {
                    Said::Gone(format!(
                        "it answered for slot {into}, which it was not reading"
                    ))
                }
                s => s,
            };
            match s {
                Said::Done(into) => {
                    self.answered.insert(into, Ok(()));
                }
                Said::Failed(into, why) => {
                    self.answered.insert(into, Err(why));
                }
                Said::Ready => {}
                Said::Gone(why) => {
                    let why = self.ended(why);
                    self.gone = Some(why);
                    return;
                }
            }
            next = self.said.try_recv().ok();
        }
    }

    fn drain_gone(&mut self) -> String {
        self.take(Some(Duration::from_secs(1)));
        self.gone
            .clone()
            .unwrap_or_else(|| "the NIXL reader process does not answer".into())
    }

    /// The loan of pool slot `into` once its read has landed (`None` while it runs); a failed
    /// read, or a reader that ended, is an error.
    pub fn poll(&mut self, into: u32) -> Result<Option<Loan>, String> {
        self.take(None);
        self.settle(into)
    }

    fn settle(&mut self, into: u32) -> Result<Option<Loan>, String> {
        match self.answered.remove(&into) {
            Some(Ok(())) => self
                .landing
                .remove(&into)
                .map(Some)
                .ok_or_else(|| format!("no read into slot {into}")),
            Some(Err(why)) => {
                self.landing.remove(&into);
                Err(format!("the read into slot {into} failed: {why}"))
            }
            None => match &self.gone {
                // The process that could write the slot is gone: its loan can go back.
                Some(why) => {
                    self.landing.remove(&into);
                    Err(why.clone())
                }
                None => Ok(None),
            },
        }
    }

    /// Waits at most `timeout` for the read into pool slot `into` and gives its loan back. A
    /// read that does not land in time keeps its loan while the reader lives (it may still
    /// write the slot).
    pub fn wait(&mut self, into: u32, timeout: Duration) -> Result<Loan, String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(loan) = self.poll(into)? {
                return Ok(loan);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "the read into slot {into} did not land within {} s",
                    timeout.as_secs_f64()
                ));
            }
            self.take(Some(left.min(Duration::from_millis(50))));
            if let Some(loan) = self.settle(into)? {
                return Ok(loan);
            }
        }
    }
}

impl Drop for ReaderProcess {
    fn drop(&mut self) {
        // The reader ends with its input; reads still under way are waited for (a second at
        // most) before it is killed, and their loans go back only once it is gone.
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(1);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.landing.clear();
    }
}

fn parse(line: &str) -> Said {
    let mut parts = line.splitn(3, ' ');
    let slot = |s: Option<&str>| s.and_then(|s| s.parse::<u32>().ok());
    match (parts.next(), parts.next(), parts.next()) {
        (Some("OK"), None, None) => Said::Ready,
        (Some("D"), n, None) => slot(n).map_or_else(|| Said::Gone(format!("{line:?}")), Said::Done),
        (Some("F"), n, why) => match slot(n) {
            Some(n) => Said::Failed(n, why.unwrap_or("").to_string()),
            None => Said::Gone(format!("{line:?}")),
        },
        (Some("E"), _, _) => Said::Gone(line[1..].trim().to_string()),
        _ => Said::Gone(format!("it said {line:?}")),
    }
}

/// The reader process's side (`tensorport-bridge nixl-reader`): maps the pool at `pool_path`
/// (`slots` slots of `slot_size` bytes), reads the set-up from standard input, loads it into
/// NIXL agent `name`, says `OK`, and reads slots as told until its input ends. Returns its exit
/// status. `note` says what the process refused, if anything, for its failures' answers (the
/// executable confines its connections before this starts).
pub fn serve(
    pool_path: &Path,
    slots: u32,
    slot_size: u64,
    name: &str,
    note: &dyn Fn() -> Option<String>,
) -> u8 {
    // Answers go on a copy of standard output, and standard output itself becomes standard
    // error: UCX writes its own messages to standard output, which must not read as answers.
    let mut out = match nix::unistd::dup(std::io::stdout())
        .and_then(|fd| nix::unistd::dup2_stdout(std::io::stderr()).map(|()| fd))
    {
        Ok(fd) => std::fs::File::from(fd),
        Err(e) => {
            eprintln!("tensorport-bridge nixl-reader: cannot set its output aside: {e}");
            return 1;
        }
    };
    let mut say = |line: String| {
        // Only failures carry the note: a landed read (`D`, once per read) does not look.
        let failure = line.starts_with('F') || line.starts_with('E');
        let line = match failure.then(&note).flatten() {
            Some(n) => format!("{line} ({n})"),
            None => line,
        };
        let _ = writeln!(out, "{line}").and_then(|()| out.flush());
    };
    let mut lines = BufReader::new(std::io::stdin()).lines();
    let set_up = (|| -> Result<tensorport_nixl::Reader, String> {
        let json = lines
            .next()
            .ok_or("no set-up")?
            .map_err(|e| e.to_string())?;
        let hello = Hello::from_json(&json, u64::MAX).map_err(|e| e.to_string())?;
        let fd: std::os::fd::OwnedFd = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(pool_path)
            .map_err(|e| format!("the pool {}: {e}", pool_path.display()))?
            .into();
        let pool = HostPool::open(fd, slots, slot_size).map_err(|e| e.to_string())?;
        let (agent, peer) = crate::nixl_setup::peer_of(&hello, name)?;
        // The gateway holds the loan of every slot this process reads into until this process
        // has said the read landed (or has ended), so nothing reads or writes it meanwhile.
        tensorport_nixl::Reader::into_owned_pool(&agent, pool, peer).map_err(|e| e.to_string())
    })();
    let mut reader = match set_up {
        Ok(r) => r,
        Err(why) => {
            say(format!("E {why}"));
            return 1;
        }
    };
    say("OK".into());
    let (tx, rx) = mpsc::channel::<(u32, u32)>();
    std::thread::spawn(move || {
        for line in lines {
            let Ok(line) = line else { break };
            let mut p = line.split(' ');
            let (Some("R"), Some(Ok(from)), Some(Ok(into)), None) = (
                p.next(),
                p.next().map(str::parse::<u32>),
                p.next().map(str::parse::<u32>),
                p.next(),
            ) else {
                break;
            };
            if tx.send((from, into)).is_err() {
                break;
            }
        }
    });
    let mut pending: Vec<u32> = Vec::new();
    let mut open = true;
    loop {
        // New reads: wait for one when nothing runs, else take what has come.
        while open {
            let next = if pending.is_empty() {
                rx.recv().map_err(|_| mpsc::TryRecvError::Disconnected)
            } else {
                rx.try_recv()
            };
            match next {
                Ok((from, into)) => match reader.start(from, into) {
                    Ok(()) => pending.push(into),
                    Err(e) => say(format!("F {into} {e}")),
                },
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => open = false,
            }
        }
        if !open && pending.is_empty() {
            return 0;
        }
        pending.retain(|&into| match reader.poll(into) {
            Ok(true) => {
                say(format!("D {into}"));
                false
            }
            Ok(false) => true,
            Err(e) => {
                say(format!("F {into} {e}"));
                false
            }
        });
    }
}
