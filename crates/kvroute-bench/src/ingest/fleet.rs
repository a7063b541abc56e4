//! The publisher processes of `kvroute bench ingest`, seen from the parent:
//! started as `EXE bench-publisher …`, driven by lines on their stdin,
//! answering on their stdout (see [`super::publisher`]), killed when dropped.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use super::publisher::FloodCounts;
use crate::error::{Error, Result};

/// What every publisher process is given, beside its workers' ports.
#[derive(Debug, Clone)]
pub(crate) struct PublisherFlags {
    /// Ranks per worker.
    pub dp: u32,
    /// Stored events per batch.
    pub events_per_batch: u32,
    /// Blocks per stored event.
    pub blocks_per_event: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Batches each rank keeps for replay.
    pub replay_buffer: usize,
}

/// One running publisher process.
struct PublisherChild {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
}

impl PublisherChild {
    fn spawn(exe: &Path, flags: &PublisherFlags, ports: &[(u16, u16)], seed: u64) -> Result<Self> {
        let list: Vec<String> = ports.iter().map(|(e, r)| format!("{e}/{r}")).collect();
        let mut child = Command::new(exe)
            .arg("bench-publisher")
            .args(["--dp", &flags.dp.to_string()])
            .args(["--ports", &list.join(",")])
            .args(["--events-per-batch", &flags.events_per_batch.to_string()])
            .args(["--blocks-per-event", &flags.blocks_per_event.to_string()])
            .args(["--block-size", &flags.block_size.to_string()])
            .args(["--replay-buffer", &flags.replay_buffer.to_string()])
            .args(["--seed", &seed.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(Error::io(format!(
                "starting {} bench-publisher",
                exe.display()
            )))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            return Err(Error::Unexpected("a publisher's pipes are missing".into()));
        };
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Ok(PublisherChild {
            child,
            stdin,
            lines,
        })
    }

    fn send(&mut self, line: &str) -> Result<()> {
        writeln!(self.stdin, "{line}")
            .and_then(|()| self.stdin.flush())
            .map_err(Error::io("sending a publisher its command"))
    }

    /// The next line the publisher prints, split in words after `word`.
    fn expect(&mut self, word: &str, timeout: Duration) -> Result<Vec<u64>> {
        let line = self.lines.recv_timeout(timeout).map_err(|_| {
            let status = self.child.try_wait().ok().flatten();
            Error::Timeout(format!(
                "publisher {} did not say `{word}` (exit status: {status:?})",
                self.child.id()
            ))
        })?;
        let mut words = line.split_whitespace();
        if words.next() != Some(word) {
            return Err(Error::Unexpected(format!(
                "a publisher said {line:?} instead of `{word} …`"
            )));
        }
        words
            .map(|w| {
                w.parse()
                    .map_err(|_| Error::Unexpected(format!("a publisher said {line:?}")))
            })
            .collect()
    }
}

impl Drop for PublisherChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every publisher process, each serving whole workers.
pub(crate) struct Publishers {
    children: Vec<PublisherChild>,
}

impl Publishers {
    /// Starts one process per `groups` entry (each a list of workers' base
    /// ports) and waits until each has bound all its sockets.
    pub(crate) fn start(
        exe: &Path,
        flags: &PublisherFlags,
        groups: &[&[(u16, u16)]],
        seed: u64,
    ) -> Result<Self> {
        let mut children = Vec::new();
        for (i, ports) in groups.iter().enumerate() {
            children.push(PublisherChild::spawn(exe, flags, ports, seed + i as u64)?);
        }
        for (child, ports) in children.iter_mut().zip(groups) {
            let ready = child.expect("ready", Duration::from_secs(60))?;
            let want = ports.len() as u64 * u64::from(flags.dp);
            if ready.first() != Some(&want) {
                return Err(Error::Unexpected(format!(
                    "a publisher serves {ready:?} ranks, not {want}"
                )));
            }
        }
        Ok(Publishers { children })
    }

    /// The publishers' process ids.
    pub(crate) fn pids(&self) -> Vec<u32> {
        self.children.iter().map(|c| c.child.id()).collect()
    }

    /// Tells every publisher to flood for `duration` at their share of
    /// `batches_per_sec` (0: unpaced); returns at once.
    pub(crate) fn start_flood(&mut self, duration: Duration, batches_per_sec: u64) -> Result<()> {
        let share = batches_per_sec.div_ceil(self.children.len().max(1) as u64);
        let command = format!("flood {} {share}", duration.as_millis());
        self.children.iter_mut().try_for_each(|c| c.send(&command))
    }

    /// Waits for every publisher's end of flood and sums their counts.
    pub(crate) fn flood_counts(&mut self, timeout: Duration) -> Result<FloodCounts> {
        let mut sum = FloodCounts::default();
        for child in &mut self.children {
            match child.expect("flooded", timeout)?.as_slice() {
                &[batches, stored, removed, replays] => {
                    sum.batches += batches;
                    sum.stored_blocks += stored;
                    sum.removed_blocks += removed;
                    sum.replays += replays;
                }
                other => {
                    return Err(Error::Unexpected(format!(
                        "a publisher's flood counts are {other:?}"
                    )))
                }
            }
        }
        Ok(sum)
    }

    /// Asks every publisher to exit, then waits for them (killed if late).
    pub(crate) fn stop(mut self) {
        for child in &mut self.children {
            let _ = child.send("quit");
        }
        for child in &mut self.children {
            for _ in 0..50 {
                if !matches!(child.child.try_wait(), Ok(None)) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}
