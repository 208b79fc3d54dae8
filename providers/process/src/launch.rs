//! `process-launch`: the last step before a container's program runs. The shim
//! (and exec) start it already as the run-as user; it applies the resource
//! limits it was given to itself and then replaces itself with the program, so
//! the limits hold from the first instruction with no unsafe pre-exec hook.
//!
//! `<launcher> process-launch [--rlimit-data BYTES] [--cgroup DIR] -- PROGRAM ARGS...`

use std::os::unix::process::CommandExt;

/// Runs the launcher; returns only on failure, with the exit code to use
/// (127: the program is missing, 126: it cannot be run, 125: bad arguments).
pub fn main(args: &[String]) -> i32 {
    let mut data_limit = None;
    let mut cgroup = None;
    let mut it = args.iter();
    let mut argv: Vec<&String> = Vec::new();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--rlimit-data" => data_limit = it.next().and_then(|v| v.parse::<u64>().ok()),
            "--cgroup" => cgroup = it.next().cloned(),
            "--" => {
                argv = it.by_ref().collect();
                break;
            }
            other => {
                eprintln!("process-launch: unknown argument {other:?}");
                return 125;
            }
        }
    }
    let Some((program, rest)) = argv.split_first() else {
        eprintln!("process-launch: no program given");
        return 125;
    };
    if let Some(dir) = cgroup {
        let procs = std::path::Path::new(&dir).join("cgroup.procs");
        if let Err(e) = std::fs::write(&procs, std::process::id().to_string()) {
            eprintln!("process-launch: joining cgroup {dir}: {e}");
        }
    }
    if let Some(bytes) = data_limit {
        let limit = rustix::process::Rlimit {
            current: Some(bytes),
            maximum: Some(bytes),
        };
        if let Err(e) = rustix::process::setrlimit(rustix::process::Resource::Data, limit) {
            eprintln!("process-launch: setting the memory limit: {e}");
            return 126;
        }
    }
    let err = std::process::Command::new(program).args(rest).exec();
    eprintln!("exec: {program:?}: {err}");
    if err.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    }
}
