//! Process identity and usage from /proc.
//!
//! A PID alone is not an identity: after a restart of the machine or enough forks
//! it names someone else. A [`ProcessId`] pairs it with the process's start time
//! (field 22 of /proc/PID/stat, in clock ticks since boot), which no later process
//! with the same PID shares.

use serde::{Deserialize, Serialize};
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessId {
    pub pid: i32,
    pub start_ticks: u64,
}

/// The fields of /proc/PID/stat vkd uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    pub state: char,
    pub utime_ticks: u64,
    pub stime_ticks: u64,
    /// CPU time of the children it has reaped (ended processes' time moves here).
    pub cutime_ticks: u64,
    pub cstime_ticks: u64,
    pub start_ticks: u64,
    pub rss_pages: u64,
}

/// The container's program behind launcher process `pid`: with namespaces the
/// launcher waits in the host's PID namespace while its one child, the
/// program, is the init of the container's. Without, `pid` itself.
pub fn program_of(pid: i32) -> i32 {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse().ok())
        .unwrap_or(pid)
}

/// Whether the container's program behind launcher `pid` has started: the
/// launcher's child has replaced itself (exec) with the program, so the
/// container's namespaces and root are complete. Until then the child may
/// still be in the host's mount namespace, or before its pivot: joining it
/// then would join the host's.
pub fn program_started(pid: i32) -> bool {
    let program = program_of(pid);
    program != pid && !is_launcher(program)
}

/// The exit code the kubelet reports: the program's, or 128 + the signal that killed it.
pub(crate) fn exit_code(st: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    st.code().unwrap_or_else(|| 128 + st.signal().unwrap_or(0))
}

/// Parses /proc/PID/stat text; the command name may hold spaces and parentheses.
pub fn parse_stat(text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // `f[0]` is field 3 (state); field n is f[n - 3].
    Some(Stat {
        state: f.first()?.chars().next()?,
        utime_ticks: f.get(11)?.parse().ok()?,
        stime_ticks: f.get(12)?.parse().ok()?,
        cutime_ticks: f.get(13)?.parse().ok()?,
        cstime_ticks: f.get(14)?.parse().ok()?,
        start_ticks: f.get(19)?.parse().ok()?,
        rss_pages: f.get(21)?.parse().ok()?,
    })
}

pub fn stat(pid: i32) -> Option<Stat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// CPU time `pid` and the children it reaped have used, in nanoseconds. The
/// clock-tick counters of /proc/PID/stat read 0 for a process that has run
/// for less than a tick (a shell that waits, `sleep`); the scheduler's own
/// count (/proc/PID/schedstat, its main thread, in ns) does not, so the
/// larger of the two stands for the process itself.
pub fn cpu_time_ns(pid: i32, s: &Stat) -> u64 {
    let tick = 1_000_000_000 / TICKS_PER_SECOND;
    let ticks = s
        .utime_ticks
        .saturating_add(s.stime_ticks)
        .saturating_mul(tick);
    let scheduled = std::fs::read_to_string(format!("/proc/{pid}/schedstat"))
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap_or(0);
    let reaped = s
        .cutime_ticks
        .saturating_add(s.cstime_ticks)
        .saturating_mul(tick);
    ticks.max(scheduled).saturating_add(reaped)
}

impl ProcessId {
    pub fn of(pid: i32) -> Option<Self> {
        Some(Self {
            pid,
            start_ticks: stat(pid)?.start_ticks,
        })
    }

    pub fn parse(text: &str) -> Option<Self> {
        let mut it = text.split_whitespace();
        Some(Self {
            pid: it.next()?.parse().ok()?,
            start_ticks: it.next()?.parse().ok()?,
        })
    }

    pub fn render(&self) -> String {
        format!("{} {}", self.pid, self.start_ticks)
    }

    /// The same process still runs (a zombie does not count).
    pub fn alive(&self) -> bool {
        stat(self.pid).is_some_and(|s| s.start_ticks == self.start_ticks && s.state != 'Z')
    }

    /// Signals the process group this process leads, if it is still the same process.
    pub fn signal_group(&self, signal: rustix::process::Signal) -> bool {
        if !self.alive() {
            return false;
        }
        match rustix::process::Pid::from_raw(self.pid) {
            Some(pid) => rustix::process::kill_process_group(pid, signal).is_ok(),
            None => false,
        }
    }

    /// Whether the process is still the shim's launcher (`/proc/self/exe
    /// process-launch ...`), which has not yet replaced itself with the
    /// container's program. A stop then has nobody to be graceful to.
    pub fn still_launching(&self) -> bool {
        if !self.alive() {
            return false;
        }
        if !is_launcher(self.pid) {
            return false;
        }
        // With namespaces the launcher stays, waiting for its one child: the
        // container's program, or a second launcher not yet replaced by it.
        let program = program_of(self.pid);
        if program != self.pid && !is_launcher(program) {
            return false;
        }
        // Where the executable can be read (not always, as another user), it
        // must be this very binary too.
        use std::os::unix::fs::MetadataExt;
        match (
            std::fs::metadata(format!("/proc/{}/exe", self.pid)),
            std::fs::metadata("/proc/self/exe"),
        ) {
            (Ok(theirs), Ok(ours)) => theirs.dev() == ours.dev() && theirs.ino() == ours.ino(),
            _ => true,
        }
    }

    /// Whether the process is in its first moments and SIGTERM would act on
    /// it as by default (no handler, not ignored, not blocked): a program
    /// still starting up. In a container, where
    /// the program is its PID namespace's init, a SIGTERM without a handler
    /// does nothing and the runtime kills it (137); here it would end the
    /// program at once with 143, as if it had been running and stopped.
    pub fn starting_without_sigterm_handler(&self) -> bool {
        const STARTING: Duration = Duration::from_millis(250);
        // With namespaces, the program behind the launcher that waits for it.
        let program = if is_launcher(self.pid) {
            program_of(self.pid)
        } else {
            self.pid
        };
        self.alive()
            && self.age().is_some_and(|a| a < STARTING)
            && default_disposition(program, 15) == Some(true)
    }

    /// How long ago the process started, at the clock tick's resolution.
    fn age(&self) -> Option<Duration> {
        let uptime = std::fs::read_to_string("/proc/uptime").ok()?;
        let since_boot: f64 = uptime.split_whitespace().next()?.parse().ok()?;
        let started = self.start_ticks as f64 / TICKS_PER_SECOND as f64;
        Duration::try_from_secs_f64((since_boot - started).max(0.0)).ok()
    }

    pub fn signal(&self, signal: rustix::process::Signal) -> bool {
        if !self.alive() {
            return false;
        }
        match rustix::process::Pid::from_raw(self.pid) {
            Some(pid) => rustix::process::kill_process(pid, signal).is_ok(),
            None => false,
        }
    }
}

/// Whether signal number `signal` would act on process `pid` as by default:
/// neither caught, nor ignored, nor blocked (`SigCgt`, `SigIgn`, `SigBlk` in
/// /proc/PID/status); `None` when that cannot be read.
fn default_disposition(pid: i32, signal: u32) -> Option<bool> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let bit = 1u64 << (signal - 1);
    let mut set = false;
    for key in ["SigCgt:", "SigIgn:", "SigBlk:"] {
        let mask = status.lines().find_map(|l| l.strip_prefix(key))?.trim();
        set |= u64::from_str_radix(mask, 16).ok()? & bit != 0;
    }
    Some(!set)
}

/// Whether a /proc/PID/cmdline is the launcher's, as the shim starts it.
/// Whether process `pid` is this program's launcher (`process-launch`).
pub(crate) fn is_launcher(pid: i32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| is_launcher_cmdline(&c))
}

fn is_launcher_cmdline(cmdline: &[u8]) -> bool {
    let mut args = cmdline.split(|b| *b == 0);
    args.next() == Some(b"/proc/self/exe") && args.next() == Some(b"process-launch")
}

/// Clock ticks per second (USER_HZ); 100 on every Linux vkd targets.
pub const TICKS_PER_SECOND: u64 = 100;

pub fn page_size() -> u64 {
    rustix::param::page_size() as u64
}

/// Total memory of the host in bytes, from /proc/meminfo.
pub fn mem_total() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The PIDs of every process in `pgid`'s group (scanning /proc).
pub fn group_members(pgid: i32) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|t| {
                    let rest = &t[t.rfind(')')? + 1..];
                    rest.split_whitespace().nth(2)?.parse::<i32>().ok()
                })
                == Some(pgid)
        })
        .collect()
}

/// The direct children of `pid`, from every thread's `children` list (orphans
/// re-parented to a subreaper may hang below any of its threads).
pub fn children(pid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    let mut listed = false;
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            if let Ok(text) = std::fs::read_to_string(t.path().join("children")) {
                listed = true;
                out.extend(
                    text.split_whitespace()
                        .filter_map(|p| p.parse::<i32>().ok()),
                );
            }
        }
    }
    if !listed {
        // A kernel without CONFIG_PROC_CHILDREN: every process's parent, from stat.
        out = children_by_scan(pid);
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// The children of `pid`, found by reading every /proc/PID/stat (field 4 is the parent).
fn children_by_scan(pid: i32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|child| {
            std::fs::read_to_string(format!("/proc/{child}/stat")).is_ok_and(|text| {
                text.rfind(')')
                    .and_then(|i| text[i + 1..].split_whitespace().nth(1)?.parse::<i32>().ok())
                    == Some(pid)
            })
        })
        .collect()
}

/// Every process below `pid`, children first.
pub fn descendants(pid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    let mut next = vec![pid];
    while let Some(p) = next.pop() {
        for c in children(p) {
            if !out.contains(&c) {
                out.push(c);
                next.push(c);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_launcher_is_known_by_its_command_line() {
        assert!(is_launcher_cmdline(
            b"/proc/self/exe\0process-launch\0--cwd\0/\0--\0/bin/false\0"
        ));
        assert!(!is_launcher_cmdline(b"/bin/false\0"));
        assert!(!is_launcher_cmdline(b"/proc/self/exe\0exec\0"));
        assert!(!is_launcher_cmdline(b""));
        // After exec the process is the program, not the launcher.
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let id = ProcessId::of(child.id() as i32).unwrap();
        assert!(!id.still_launching());
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn both_ways_of_finding_children_agree() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let me = std::process::id() as i32;
        let pid = child.id() as i32;
        assert!(children(me).contains(&pid));
        assert!(children_by_scan(me).contains(&pid));
        let _ = child.kill();
        let _ = child.wait();
    }

    #[test]
    fn stat_survives_odd_command_names() {
        let text = "1234 (a (b) c) S 1 1234 1234 0 -1 4194304 100 0 0 0 7 3 0 0 20 0 1 0 987654 1000000 250 18446744073709551615";
        let s = parse_stat(text).unwrap();
        assert_eq!(s.state, 'S');
        assert_eq!((s.utime_ticks, s.stime_ticks), (7, 3));
        assert_eq!(s.start_ticks, 987654);
        assert_eq!(s.rss_pages, 250);
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn a_program_starting_up_without_a_sigterm_handler_is_known() {
        let mut plain = std::process::Command::new("sleep")
            .arg("10")
            .spawn()
            .unwrap();
        let mut trapping = std::process::Command::new("sh")
            .args(["-c", "trap 'exit 0' TERM; sleep 10 & wait"])
            .spawn()
            .unwrap();
        // Ignoring SIGTERM is no default either: it is sent, and does nothing.
        let mut ignoring = std::process::Command::new("sh")
            .args(["-c", "trap '' TERM; sleep 10 & wait"])
            .spawn()
            .unwrap();
        let plain_id = ProcessId::of(plain.id() as i32).unwrap();
        let trapping_id = ProcessId::of(trapping.id() as i32).unwrap();
        assert!(plain_id.starting_without_sigterm_handler());
        std::thread::sleep(Duration::from_millis(400));
        assert!(
            !plain_id.starting_without_sigterm_handler(),
            "no longer starting"
        );
        assert_eq!(default_disposition(trapping.id() as i32, 15), Some(false));
        assert!(!trapping_id.starting_without_sigterm_handler());
        assert_eq!(default_disposition(ignoring.id() as i32, 15), Some(false));
        for c in [&mut plain, &mut trapping, &mut ignoring] {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    #[test]
    fn own_identity_is_alive_and_a_changed_start_is_not() {
        let me = ProcessId::of(std::process::id() as i32).unwrap();
        assert!(me.alive());
        assert_eq!(ProcessId::parse(&me.render()), Some(me));
        let other = ProcessId {
            start_ticks: me.start_ticks + 1,
            ..me
        };
        assert!(!other.alive());
    }
}
