//! The router under test as a real child process: `kvroute serve` started
//! from a given executable on an ephemeral port, its CPU time, resident
//! memory and threads read from `/proc/PID/{stat,status}`, killed when
//! dropped. Used by `bench proxy`, `bench ingest` and `bench replicas`.
//!
//! A separate process is what makes the router's CPU and memory measurable
//! apart from the load generator's and the mock engines' or publishers'.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use crate::error::{Error, Result};

/// What `kvroute serve` prints on stderr once it listens, before the URL.
const LISTENING: &str = "listening on ";

/// A running `kvroute serve`.
#[derive(Debug)]
pub(crate) struct RouterProcess {
    child: Child,
    /// `http://127.0.0.1:PORT`, from the router's own listening line.
    pub url: String,
}

impl RouterProcess {
    /// Runs `exe serve --port P --log warn` on a free port P with a
    /// `--worker` per spec and `extra` flags, and waits (at most 30 s) for
    /// its listening line (a chosen port, not 0, so that builds which print
    /// the port they were given can be measured too). The router's other
    /// stderr lines are passed on to this process's stderr.
    pub(crate) fn spawn(exe: &Path, workers: &[String], extra: &[String]) -> Result<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(Error::io("finding a free port for the router"))?
            .port()
            .to_string();
        let mut command = Command::new(exe);
        command.args([
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            &port,
            "--log",
            "warn",
        ]);
        for spec in workers {
            command.arg("--worker").arg(spec);
        }
        let mut child = command
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(Error::io(format!("starting {} serve", exe.display())))?;
        let Some(stderr) = child.stderr.take() else {
            let _ = child.kill();
            return Err(Error::Unexpected("the router's stderr is not piped".into()));
        };
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                match line.split_once(LISTENING) {
                    Some(_) => {
                        let _ = tx.send(());
                    }
                    None => {
                        let _ = writeln!(std::io::stderr().lock(), "[router] {line}");
                    }
                }
            }
        });
        let mut router = RouterProcess {
            child,
            url: format!("http://127.0.0.1:{port}"),
        };
        rx.recv_timeout(Duration::from_secs(30)).map_err(|_| {
            let status = router.child.try_wait().ok().flatten();
            Error::Timeout(format!(
                "the router printed no listening line (exit status: {status:?})"
            ))
        })?;
        Ok(router)
    }

    /// The router's resident memory and thread count now.
    pub(crate) fn status(&self) -> Result<ProcStatus> {
        let path = format!("/proc/{}/status", self.child.id());
        let text = std::fs::read_to_string(&path).map_err(Error::io(format!("reading {path}")))?;
        ProcStatus::parse(&text)
            .ok_or_else(|| Error::Unexpected(format!("{path} has no VmRSS and Threads lines")))
    }

    /// The router's CPU time so far, user and system.
    pub(crate) fn cpu_time(&self) -> Result<Duration> {
        cpu_time_of(self.child.id())
    }

    /// Kills the router with SIGKILL (no clean shutdown: a crash, as
    /// `kill -9` would) and waits for it to exit.
    pub(crate) fn kill(&mut self) -> Result<()> {
        // `kill` fails only when the child has already exited; `wait` reaps it either way.
        let _ = self.child.kill();
        self.child
            .wait()
            .map_err(Error::io("waiting for the killed router to exit"))?;
        Ok(())
    }
}

/// The CPU time (user + system) process `pid` has used so far.
pub(crate) fn cpu_time_of(pid: u32) -> Result<Duration> {
    let path = format!("/proc/{pid}/stat");
    let text = std::fs::read_to_string(&path).map_err(Error::io(format!("reading {path}")))?;
    let ticks = cpu_ticks(&text)
        .ok_or_else(|| Error::Unexpected(format!("{path} has no utime and stime")))?;
    Ok(Duration::from_secs_f64(
        ticks as f64 / clock_ticks_per_second() as f64,
    ))
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What `/proc/PID/status` says of a process's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcStatus {
    /// Resident set size, KiB (`VmRSS`).
    pub rss_kib: u64,
    /// Threads (`Threads`).
    pub threads: u64,
}

impl ProcStatus {
    /// The `VmRSS:` (in kB) and `Threads:` lines of a `/proc/PID/status` text.
    fn parse(text: &str) -> Option<Self> {
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name))?
                .split_whitespace()
                .next()?
                .parse::<u64>()
                .ok()
        };
        Some(ProcStatus {
            rss_kib: field("VmRSS:")?,
            threads: field("Threads:")?,
        })
    }
}

/// utime + stime (fields 14 and 15, in clock ticks) of a `/proc/PID/stat`
/// line. The command name (field 2) is in parentheses and may hold spaces or
/// parentheses itself, so fields are counted after its last `)`.
fn cpu_ticks(stat: &str) -> Option<u64> {
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// Clock ticks per second of `/proc`'s CPU times (`sysconf(_SC_CLK_TCK)`;
/// 100 when the system does not say).
#[allow(unsafe_code)]
fn clock_ticks_per_second() -> u64 {
    // SAFETY: sysconf takes a plain integer, reads no memory of ours and has
    // no preconditions; it returns -1 for an unknown name.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    u64::try_from(ticks).ok().filter(|&t| t > 0).unwrap_or(100)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_are_utime_plus_stime_whatever_the_command_name() {
        let stat =
            "4242 (kvroute) S 1 4242 4242 0 -1 4194560 2046 0 0 0 157 43 0 0 20 0 6 0 1234 0 0";
        assert_eq!(cpu_ticks(stat), Some(157 + 43));
        let odd = "7 (a (b) c) R 1 7 7 0 -1 0 0 0 0 0 5 6 0 0 20 0 1 0 1 0 0";
        assert_eq!(cpu_ticks(odd), Some(11));
        assert_eq!(cpu_ticks("7 (x) R 1"), None);
        assert_eq!(cpu_ticks("no parenthesis"), None);
    }

    #[test]
    fn status_gives_resident_kib_and_threads() {
        let text = "Name:\tkvroute\nVmPeak:\t  9000 kB\nVmRSS:\t  4321 kB\nThreads:\t7\n";
        assert_eq!(
            ProcStatus::parse(text),
            Some(ProcStatus {
                rss_kib: 4321,
                threads: 7
            })
        );
        assert_eq!(ProcStatus::parse("Name:\tx\nThreads:\t1\n"), None);
        let own = std::fs::read_to_string("/proc/self/status").expect("/proc is mounted");
        assert!(ProcStatus::parse(&own).is_some_and(|s| s.threads >= 1 && s.rss_kib > 0));
    }

    #[test]
    fn this_process_uses_some_cpu_and_ticks_are_known() {
        assert!(clock_ticks_per_second() >= 1);
        let text = std::fs::read_to_string(format!("/proc/{}/stat", std::process::id()))
            .expect("/proc is mounted");
        assert!(cpu_ticks(&text).is_some(), "{text}");
    }
}
