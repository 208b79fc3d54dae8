//! `process-launch`: the last step before a container's program runs. The shim
//! (and exec) start it in the container's environment and working directory; it
//! joins the container's cgroup, applies its resource limits, drops to the
//! run-as user and then replaces itself with the program. So the limits and the
//! user hold from the program's first instruction, with no unsafe pre-exec hook.
//! It is single-threaded, so the per-thread identity calls change the whole process.
//!
//! `<launcher> process-launch [--rlimit-data BYTES] [--cgroup DIR] [--user UID:GID] -- PROGRAM ARGS...`

use std::os::unix::process::CommandExt;

/// Runs the launcher; returns only on failure, with the exit code to use
/// (127: the program is missing, 126: it cannot be run, 125: bad arguments).
pub fn main(args: &[String]) -> i32 {
    let mut data_limit = None;
    let mut cgroup = None;
    let mut user: Option<(u32, u32)> = None;
    let mut it = args.iter();
    let mut argv: Vec<&String> = Vec::new();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--rlimit-data" => data_limit = it.next().and_then(|v| v.parse::<u64>().ok()),
            "--cgroup" => cgroup = it.next().cloned(),
            "--user" => {
                user = it.next().and_then(|v| {
                    let (u, g) = v.split_once(':')?;
                    Some((u.parse().ok()?, g.parse().ok()?))
                });
                if user.is_none() {
                    eprintln!("process-launch: --user wants UID:GID");
                    return 125;
                }
            }
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
    if let Some((uid, gid)) = user {
        let gid = rustix::process::Gid::from_raw(gid);
        let uid = rustix::process::Uid::from_raw(uid);
        let dropped = rustix::thread::set_thread_groups(&[gid])
            .and_then(|()| rustix::thread::set_thread_res_gid(gid, gid, gid))
            .and_then(|()| rustix::thread::set_thread_res_uid(uid, uid, uid));
        if let Err(e) = dropped {
            eprintln!("process-launch: switching to uid {}: {e}", uid.as_raw());
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
