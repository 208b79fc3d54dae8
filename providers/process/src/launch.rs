//! `process-launch`: the last step before a container's program runs. The shim
//! (and exec) start it as root with an empty environment; it joins the
//! container's cgroup, applies its resource limits, drops to the run-as user,
//! and only then takes the Pod's environment and working directory and replaces
//! itself with the program. So the limits and the user hold from the program's
//! first instruction, with no unsafe pre-exec hook, and nothing the Pod controls
//! (LD_PRELOAD, LD_AUDIT, LD_DEBUG_OUTPUT, a `..` working directory) is seen by
//! a process with more privilege than the Pod: glibc reads those variables when
//! the launcher starts, and the launcher starts without them.
//! It is single-threaded, so the per-thread identity calls change the whole process.
//!
//! `<launcher> process-launch [--rlimit-data BYTES] [--rlimit-nproc N] [--cgroup DIR]
//!  [--user UID:GID] [--env-file FILE] [--cwd DIR]
//!  [--sandbox PLAN [--share-pid PID] | --enter PID | --pause] -- PROGRAM ARGS...`
//!
//! With `--sandbox` (a container's run) or `--enter` (exec, a probe, a hook
//! in a running container) the program gets namespaces (`isolation`): the
//! launcher makes a new PID namespace, or enters the container's, and starts
//! itself again there (`--stage2`) as that namespace's process; the second
//! launcher makes or enters the mount and UTS namespaces and becomes the
//! program. The first stays, as the run-as user, to wait for it and exit as
//! it did: the shim's view of a container is one process either way.
//!
//! `shareProcessNamespace: true` gives the Pod one PID namespace, held by a
//! pause process (`--pause`: the namespace's init, as the run-as user, which
//! reaps what the containers leave); each container's launcher enters it
//! (`--share-pid`, the pause launcher's PID) instead of making its own.
//!
//! The env file is JSON, `[["NAME","value"], ...]`, written by the provider
//! (mode 0600) and read before the identity changes.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::Path;

mod sync;

use sync::Sync;

/// How the shim and the provider's exec ask for a launch: the one place that
/// writes the launcher's command line.
#[derive(Debug)]
pub struct LaunchArgs<'a> {
    pub cgroup: Option<&'a Path>,
    pub data_limit: Option<u64>,
    pub nproc_limit: Option<u64>,
    pub user: Option<(u32, u32)>,
    pub env_file: &'a Path,
    pub cwd: &'a Path,
    pub isolation: Option<Isolation<'a>>,
    /// What the program's processes may gain (`hardening`).
    pub privileges: crate::hardening::Privileges,
    pub argv: &'a [String],
}

/// The namespaces a launch gets (see the module's docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isolation<'a> {
    /// New ones, built from the mount plan in this file, held in `held`
    /// once made (`isolation::hold`).
    New { plan: &'a Path, held: &'a Path },
    /// Those held in `held`, of the container whose launcher is `launcher`.
    Enter { launcher: i32, held: &'a Path },
    /// New ones from the plan, but the PID namespace of the Pod's pause
    /// launcher (`shareProcessNamespace`).
    Shared {
        plan: &'a Path,
        held: &'a Path,
        pause: i32,
    },
    /// New ones from the plan, but the PID namespace held in `target` (an
    /// ephemeral container's `targetContainerName`).
    Target {
        plan: &'a Path,
        held: &'a Path,
        target: &'a Path,
    },
    /// The Pod's pause process, the init of its shared PID namespace.
    Pause,
}

/// The limits that the cgroup a process joins (`joined`, with the controllers
/// its hierarchy enables) does not enforce, as rlimits: memory as RLIMIT_DATA,
/// processes as RLIMIT_NPROC. One rule for the shim's launches and exec's.
pub fn rlimits(
    joined: Option<&crate::cgroup::CgroupParent>,
    memory: Option<u64>,
    pids: Option<u64>,
) -> (Option<u64>, Option<u64>) {
    (
        memory.filter(|_| !joined.is_some_and(|c| c.memory)),
        pids.filter(|_| !joined.is_some_and(|c| c.pids)),
    )
}

impl LaunchArgs<'_> {
    /// A command for `launcher` with a clean environment, started in `/`: the
    /// Pod's environment and working directory reach only the final program.
    pub fn command(&self, launcher: &Path) -> std::process::Command {
        let mut cmd = std::process::Command::new(launcher);
        cmd.arg("process-launch")
            .args(self.args())
            .env_clear()
            .current_dir("/");
        cmd
    }

    fn args(&self) -> Vec<OsString> {
        let mut a: Vec<OsString> = Vec::new();
        let mut flag = |f: &str, v: OsString| {
            a.push(f.into());
            a.push(v);
        };
        if let Some(cg) = self.cgroup {
            flag("--cgroup", cg.into());
        }
        if let Some(b) = self.data_limit {
            flag("--rlimit-data", b.to_string().into());
        }
        if let Some(n) = self.nproc_limit {
            flag("--rlimit-nproc", n.to_string().into());
        }
        if let Some((u, g)) = self.user {
            flag("--user", format!("{u}:{g}").into());
        }
        flag("--env-file", self.env_file.into());
        flag("--cwd", self.cwd.into());
        flag("--privileges", self.privileges.to_arg().into());
        match self.isolation {
            Some(Isolation::New { plan, held }) => {
                flag("--sandbox", plan.into());
                flag("--held", held.into());
            }
            Some(Isolation::Enter { launcher, held }) => {
                flag("--enter", launcher.to_string().into());
                flag("--held", held.into());
            }
            Some(Isolation::Shared { plan, held, pause }) => {
                flag("--sandbox", plan.into());
                flag("--held", held.into());
                flag("--share-pid", pause.to_string().into());
            }
            Some(Isolation::Target { plan, held, target }) => {
                flag("--sandbox", plan.into());
                flag("--held", held.into());
                flag("--share-held-pid", target.into());
            }
            Some(Isolation::Pause) => a.push("--pause".into()),
            None => {}
        }
        a.push("--".into());
        a.extend(self.argv.iter().map(OsString::from));
        a
    }
}

/// Waits, a while at most, until the program behind launcher `pid` runs in
/// its namespaces: an exec or hook that comes as the container starts enters
/// what the program sees, or nothing, never the host's namespaces.
fn await_program(pid: i32) -> Result<(), String> {
    for _ in 0..1000 {
        if crate::procfs::program_started(pid) {
            return Ok(());
        }
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            return Err("the container is not running".into());
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    Err("the container's program has not started".into())
}

/// What the launcher was asked to do.
#[derive(Debug, Default, PartialEq, Eq)]
struct Request {
    data_limit: Option<u64>,
    nproc_limit: Option<u64>,
    cgroup: Option<String>,
    user: Option<(u32, u32)>,
    env_file: Option<String>,
    cwd: Option<String>,
    sandbox: Option<String>,
    enter: Option<i32>,
    /// The Pod's pause launcher, whose PID namespace the container enters.
    share_pid: Option<i32>,
    /// This is the Pod's pause process.
    pause: bool,
    /// Where the container's namespaces are held: made there (`--sandbox`)
    /// or entered from there (`--enter`).
    held: Option<String>,
    /// The PID namespace held there is joined (an ephemeral container's target).
    share_held_pid: Option<String>,
    /// What the program may gain.
    privileges: crate::hardening::Privileges,
    /// The second launcher's ends of the pipes to the first: it tells the
    /// first when its namespaces are complete, then waits to be told to go on.
    sync: Option<(i32, i32)>,
    /// The second launcher, in the container's PID namespace.
    stage2: bool,
    argv: Vec<String>,
}

fn parse(args: &[String]) -> Result<Request, String> {
    let mut r = Request::default();
    let mut it = args.iter();
    let number = |flag: &str, v: Option<&String>| -> Result<u64, String> {
        v.and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| format!("{flag} wants a number"))
    };
    while let Some(a) = it.next() {
        match a.as_str() {
            "--rlimit-data" => r.data_limit = Some(number(a, it.next())?),
            "--rlimit-nproc" => r.nproc_limit = Some(number(a, it.next())?),
            "--cgroup" => r.cgroup = Some(it.next().ok_or("--cgroup wants a directory")?.clone()),
            "--env-file" => r.env_file = Some(it.next().ok_or("--env-file wants a file")?.clone()),
            "--cwd" => r.cwd = Some(it.next().ok_or("--cwd wants a directory")?.clone()),
            "--sandbox" => {
                r.sandbox = Some(it.next().ok_or("--sandbox wants a file")?.clone());
            }
            "--enter" => {
                let pid = it
                    .next()
                    .and_then(|v| v.parse::<i32>().ok())
                    .filter(|p| *p > 0);
                r.enter = Some(pid.ok_or("--enter wants a process id")?);
            }
            "--share-pid" => {
                let pid = it
                    .next()
                    .and_then(|v| v.parse::<i32>().ok())
                    .filter(|p| *p > 0);
                r.share_pid = Some(pid.ok_or("--share-pid wants a process id")?);
            }
            "--pause" => r.pause = true,
            "--held" => r.held = Some(it.next().ok_or("--held wants a directory")?.clone()),
            "--share-held-pid" => {
                r.share_held_pid = Some(
                    it.next()
                        .ok_or("--share-held-pid wants a directory")?
                        .clone(),
                );
            }
            "--privileges" => {
                r.privileges = it
                    .next()
                    .and_then(|v| crate::hardening::Privileges::from_arg(v))
                    .ok_or("--privileges wants CAPS:NNP")?;
            }
            "--sync" => {
                let fds = it.next().and_then(|v| {
                    let (w, r) = v.split_once(':')?;
                    Some((w.parse().ok()?, r.parse().ok()?))
                });
                r.sync = Some(fds.ok_or("--sync wants WRITE:READ descriptors")?);
            }
            "--stage2" => r.stage2 = true,
            "--user" => {
                let user = it.next().and_then(|v| {
                    let (u, g) = v.split_once(':')?;
                    Some((u.parse().ok()?, g.parse().ok()?))
                });
                r.user = Some(user.ok_or("--user wants UID:GID")?);
            }
            "--" => {
                r.argv = it.by_ref().cloned().collect();
                break;
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if r.argv.is_empty() {
        return Err("no program given".into());
    }
    if [r.sandbox.is_some(), r.enter.is_some(), r.pause]
        .iter()
        .filter(|x| **x)
        .count()
        > 1
    {
        return Err("--sandbox, --enter and --pause exclude each other".into());
    }
    if (r.share_pid.is_some() || r.share_held_pid.is_some()) && r.sandbox.is_none() {
        return Err("--share-pid and --share-held-pid go with --sandbox".into());
    }
    if r.share_pid.is_some() && r.share_held_pid.is_some() {
        return Err("--share-pid and --share-held-pid exclude each other".into());
    }
    // Never a namespace looked up through what a container's processes are in now.
    if r.enter.is_some() && r.held.is_none() {
        return Err("--enter goes with --held".into());
    }
    Ok(r)
}

/// Reads the Pod's environment, as written by the provider.
fn read_env(path: &str) -> Result<Vec<(String, String)>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("reading the environment {path}: {e}"))?;
    serde_json::from_slice(&bytes).map_err(|e| format!("the environment file {path}: {e}"))
}

fn set_limit(resource: rustix::process::Resource, value: u64) -> rustix::io::Result<()> {
    let limit = rustix::process::Rlimit {
        current: Some(value),
        maximum: Some(value),
    };
    rustix::process::setrlimit(resource, limit)
}

/// Switches to the run-as user for good (all of the thread's ids).
fn drop_to(user: Option<(u32, u32)>) -> Result<(), String> {
    let Some((uid, gid)) = user else {
        return Ok(());
    };
    let gid = rustix::process::Gid::from_raw(gid);
    let uid = rustix::process::Uid::from_raw(uid);
    rustix::thread::set_thread_groups(&[gid])
        .and_then(|()| rustix::thread::set_thread_res_gid(gid, gid, gid))
        .and_then(|()| rustix::thread::set_thread_res_uid(uid, uid, uid))
        .map_err(|e| format!("switching to uid {}: {e}", uid.as_raw()))
}

fn read_plan(path: &str) -> Result<crate::isolation::MountPlan, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("reading the mount plan {path}: {e}"))?;
    serde_json::from_slice(&bytes).map_err(|e| format!("the mount plan {path}: {e}"))
}

/// The first launcher of an isolated launch: makes or enters the PID
/// namespace, starts the second launcher in it, drops to the run-as user and
/// waits, exiting as the program did (128 + the signal that killed it).
/// Signals to the container's process group reach the program directly;
/// this launcher only absorbs them, so a SIGTERM leaves the program its grace.
fn supervise(args: &[String], r: &Request) -> i32 {
    if let Some(pid) = r.enter {
        if let Err(e) = await_program(pid) {
            eprintln!("process-launch: {e}");
            return 126;
        }
        let held = r.held.as_deref().map(Path::new).unwrap_or(Path::new(""));
        let program = crate::procfs::program_of(pid);
        if let Err(e) = crate::isolation::check_unchanged(held, program) {
            eprintln!("process-launch: {e}");
            return 126;
        }
    }
    let pid_ns = match (r.enter, r.share_pid, &r.share_held_pid, &r.held) {
        (Some(_), _, _, Some(held)) => crate::isolation::join_held_pid(Path::new(held)),
        (None, Some(pause), _, _) => crate::isolation::join_pid(crate::procfs::program_of(pause)),
        (None, None, Some(target), _) => crate::isolation::join_held_pid(Path::new(target)),
        _ => crate::isolation::new_pid_namespace(),
    };
    if let Err(e) = pid_ns {
        eprintln!("process-launch: the container's PID namespace: {e}");
        return 126;
    }
    // A new container's namespaces are held once its second launcher has
    // made them, before its program runs.
    let mut hold = match r.held.as_deref().filter(|_| r.sandbox.is_some()) {
        Some(dir) => match Sync::new() {
            Ok(sync) => Some((Path::new(dir), sync)),
            Err(e) => {
                eprintln!("process-launch: {e}");
                return 126;
            }
        },
        None => None,
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("process-launch: {e}");
            return 126;
        }
    };
    runtime.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        for kind in [
            SignalKind::terminate(),
            SignalKind::interrupt(),
            SignalKind::hangup(),
            SignalKind::quit(),
            SignalKind::user_defined1(),
            SignalKind::user_defined2(),
            SignalKind::alarm(),
            SignalKind::pipe(),
        ] {
            if let Ok(mut s) = signal(kind) {
                tokio::spawn(async move { while s.recv().await.is_some() {} });
            }
        }
        let mut cmd = tokio::process::Command::new("/proc/self/exe");
        cmd.arg("process-launch").arg("--stage2");
        if let Some((_, sync)) = &hold {
            cmd.arg("--sync").arg(sync.child_arg());
        }
        let child = cmd.args(args).spawn();
        if let Some((_, sync)) = &mut hold {
            // Its ends are the second launcher's alone: its end reads as EOF here.
            sync.child_ends = None;
        }
        let mut child = match child {
            Ok(c) => c,
            Err(e) => {
                eprintln!("process-launch: starting the container's first process: {e}");
                return 126;
            }
        };
        if let Some((dir, sync)) = hold {
            let users = r
                .sandbox
                .as_deref()
                .map(read_plan)
                .transpose()
                .map(|p| p.and_then(|p| p.user_namespace));
            let held = sync.await_ready().and_then(|()| {
                let pid = child
                    .id()
                    .and_then(|p| i32::try_from(p).ok())
                    .ok_or("the container's first process is gone")?;
                if let Some(map) = users? {
                    map.write(pid).map_err(|e| e.to_string())?;
                }
                crate::isolation::hold(dir, pid).map_err(|e| e.to_string())
            });
            let go = sync.release(held.is_ok());
            if let Err(e) = held.and(go) {
                eprintln!("process-launch: holding the container's namespaces: {e}");
                let _ = child.start_kill();
                let _ = child.wait().await;
                return 126;
            }
        }
        if let Err(e) = drop_to(r.user) {
            eprintln!("process-launch: {e}");
            let _ = child.start_kill();
            let _ = child.wait().await;
            return 126;
        }
        match child.wait().await {
            Ok(st) => crate::procfs::exit_code(st),
            Err(e) => {
                eprintln!("process-launch: waiting for the container: {e}");
                126
            }
        }
    })
}

/// The Pod's pause process: the init of its shared PID namespace, as the
/// run-as user, reaping every process the containers leave until the Pod
/// ends it (SIGKILL, or its launcher's end).
fn pause(user: Option<(u32, u32)>) -> i32 {
    if let Err(e) = drop_to(user) {
        eprintln!("process-launch: {e}");
        return 126;
    }
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    loop {
        match rustix::process::wait(rustix::process::WaitOptions::empty()) {
            Ok(_) => {}
            // Nothing to reap yet: a container's orphan may come later.
            Err(_) => std::thread::sleep(std::time::Duration::from_secs(1)),
        }
    }
}

/// Runs the launcher; returns only on failure, with the exit code to use
/// (127: the program is missing, 126: it cannot be run, 125: bad arguments),
/// or as the first launcher of an isolated launch, with the program's code.
pub fn main(args: &[String]) -> i32 {
    if args == ["--check-namespaces"] {
        return if crate::isolation::check() { 0 } else { 1 };
    }
    if args == ["--check-user-namespaces"] {
        return if crate::isolation::check_user() { 0 } else { 1 };
    }
    let r = match parse(args) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("process-launch: {e}");
            return 125;
        }
    };
    if rustix::process::geteuid().is_root() && r.user.is_none_or(|(u, g)| u == 0 || g == 0) {
        eprintln!("process-launch: refusing to run a Pod's program as root");
        return 126;
    }
    if r.pause {
        return if r.stage2 {
            pause(r.user)
        } else {
            supervise(args, &r)
        };
    }
    let env = match r.env_file.as_deref().map(read_env).transpose() {
        // A shim from before an upgrade passes the environment itself; it has no file.
        Ok(None) => std::env::vars_os().collect(),
        Ok(Some(env)) => env.into_iter().map(|(k, v)| (k.into(), v.into())).collect(),
        Err(e) => {
            eprintln!("process-launch: {e}");
            return 126;
        }
    };
    // The second launcher of an isolated launch inherits the first's cgroup
    // and rlimits.
    if let Some(dir) = r.cgroup.as_ref().filter(|_| !r.stage2) {
        let procs = std::path::Path::new(dir).join("cgroup.procs");
        if let Err(e) = std::fs::write(&procs, std::process::id().to_string()) {
            // Outside its cgroup the process would escape the Pod's limits and its end.
            eprintln!("process-launch: joining cgroup {dir}: {e}");
            return 126;
        }
    }
    if let Some(bytes) = r.data_limit.filter(|_| !r.stage2)
        && let Err(e) = set_limit(rustix::process::Resource::Data, bytes)
    {
        eprintln!("process-launch: setting the memory limit: {e}");
        return 126;
    }
    if let Some(n) = r.nproc_limit.filter(|_| !r.stage2)
        && let Err(e) = set_limit(rustix::process::Resource::Nproc, n)
    {
        eprintln!("process-launch: setting the process limit: {e}");
        return 126;
    }
    if (r.sandbox.is_some() || r.enter.is_some()) && !r.stage2 {
        return supervise(args, &r);
    }
    let isolated = if let Some(plan) = &r.sandbox {
        read_plan(plan)
            .and_then(|p| {
                crate::isolation::enter_new(&p).map_err(|e| e.to_string())?;
                match &p.user_namespace {
                    Some(_) => crate::isolation::new_user_namespace().map_err(|e| e.to_string()),
                    None => Ok(()),
                }
            })
            .and_then(|()| r.sync.map_or(Ok(()), Sync::child_ready))
    } else if let Some(held) = r.held.as_deref().filter(|_| r.enter.is_some()) {
        crate::isolation::join_held(Path::new(held)).map_err(|e| e.to_string())
    } else {
        Ok(())
    };
    if let Err(e) = isolated {
        eprintln!("process-launch: the container's namespaces: {e}");
        return 126;
    }
    // The runtime's privileges, set as root; the program starts with them.
    if let Err(e) = r.privileges.apply() {
        eprintln!("process-launch: {e}");
        return 126;
    }
    if let Err(e) = drop_to(r.user) {
        eprintln!("process-launch: {e}");
        return 126;
    }
    if r.stage2 {
        // The first launcher is the container for the shim: when it goes
        // (SIGKILL of the group), so does this, and with it the namespace.
        // Set after the identity changes, which would clear it.
        let _ =
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    }
    if let Err(e) = r.privileges.finish() {
        eprintln!("process-launch: {e}");
        return 126;
    }
    // From here on, as the Pod's user: its working directory is entered with its rights.
    if let Some(dir) = &r.cwd
        && let Err(e) = std::env::set_current_dir(dir)
    {
        eprintln!("process-launch: workingDir {dir}: {e}");
        return 126;
    }
    let Some((program, rest)) = r.argv.split_first() else {
        return 125;
    };
    let env: Vec<(std::ffi::OsString, std::ffi::OsString)> = env;
    let err = std::process::Command::new(program)
        .args(rest)
        .env_clear()
        .envs(env)
        .exec();
    eprintln!("exec: {program}: {err}");
    if err.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn parses_every_flag() {
        let r = parse(&args(&[
            "--rlimit-data",
            "100",
            "--rlimit-nproc",
            "7",
            "--cgroup",
            "/cg",
            "--user",
            "1:2",
            "--env-file",
            "/e.json",
            "--cwd",
            "/w",
            "--",
            "/bin/true",
            "x",
        ]))
        .unwrap();
        assert_eq!(r.data_limit, Some(100));
        assert_eq!(r.nproc_limit, Some(7));
        assert_eq!(r.user, Some((1, 2)));
        assert_eq!(r.env_file.as_deref(), Some("/e.json"));
        assert_eq!(r.cwd.as_deref(), Some("/w"));
        assert_eq!(r.argv, args(&["/bin/true", "x"]));
        let shared = parse(&args(&["--sandbox", "/p", "--share-pid", "9", "--", "x"])).unwrap();
        assert_eq!(
            (shared.sandbox.as_deref(), shared.share_pid),
            (Some("/p"), Some(9))
        );
        assert!(parse(&args(&["--pause", "--", "pause"])).unwrap().pause);
    }

    #[test]
    fn the_command_line_round_trips_and_carries_no_environment() {
        let argv = args(&["/bin/sh", "-c", "x"]);
        let la = LaunchArgs {
            cgroup: Some(Path::new("/cg")),
            data_limit: Some(5),
            nproc_limit: None,
            user: Some((65534, 65534)),
            env_file: Path::new("/s/env/c.json"),
            cwd: Path::new("/s/root"),
            isolation: Some(Isolation::Enter {
                launcher: 42,
                held: Path::new("/state/ns/u/c"),
            }),
            privileges: crate::hardening::Privileges::of(Some(&vkd_provider::SecurityContext {
                drop_capabilities: vec!["ALL".into()],
                allow_privilege_escalation: Some(false),
                ..Default::default()
            })),
            argv: &argv,
        };
        let cmd = la.command(Path::new("/vkd"));
        assert_eq!(cmd.get_envs().count(), 0, "only cleared, nothing set");
        assert_eq!(cmd.get_current_dir(), Some(Path::new("/")));
        let line: Vec<String> = cmd
            .get_args()
            .skip(1)
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let r = parse(&line).unwrap();
        assert_eq!(r.user, Some((65534, 65534)));
        assert_eq!(r.cwd.as_deref(), Some("/s/root"));
        assert_eq!(r.enter, Some(42));
        assert_eq!(r.held.as_deref(), Some("/state/ns/u/c"));
        assert_eq!(r.privileges, la.privileges);
        assert!(r.privileges.no_new_privs);
        assert_eq!(r.argv, argv);
    }

    /// As root, the launcher never runs a Pod's program as root: it returns
    /// before touching anything.
    #[test]
    fn root_never_runs_a_pods_program_as_root() {
        if !rustix::process::geteuid().is_root() {
            return;
        }
        for user in [&["--user", "0:0"][..], &["--user", "65534:0"], &[]] {
            let mut a = args(user);
            a.extend(args(&["--", "/bin/true"]));
            assert_eq!(main(&a), 126, "{user:?}");
        }
    }

    #[test]
    fn only_what_the_cgroup_does_not_hold_becomes_an_rlimit() {
        let all = crate::cgroup::CgroupParent {
            memory: true,
            cpu: true,
            pids: true,
            ..Default::default()
        };
        let none = crate::cgroup::CgroupParent::default();
        assert_eq!(rlimits(Some(&all), Some(5), Some(7)), (None, None));
        assert_eq!(rlimits(Some(&none), Some(5), Some(7)), (Some(5), Some(7)));
        assert_eq!(rlimits(None, Some(5), None), (Some(5), None));
    }

    #[test]
    fn bad_arguments_are_errors() {
        for bad in [
            &["--rlimit-data", "lots", "--", "x"][..],
            &["--user", "1", "--", "x"],
            &["--bogus", "--", "x"],
            &["--cwd"],
            &["--"],
            &["--enter", "0", "--", "x"],
            // exec enters only what vkd holds, never a lookup through the container
            &["--enter", "5", "--", "x"],
            &["--privileges", "zz:0", "--", "x"],
            &["--sync", "5", "--", "x"],
            &["--share-held-pid", "/h", "--", "x"],
            &["--enter", "1", "--sandbox", "/p", "--", "x"],
            &["--share-pid", "5", "--", "x"],
            &["--pause", "--enter", "5", "--", "x"],
            &["--sandbox", "/p", "--share-pid", "-1", "--", "x"],
        ] {
            assert!(parse(&args(bad)).is_err(), "{bad:?}");
        }
    }
}
