//! The conformance program (`vkd provider-conformance`) against plugins over
//! the provider protocol: the sim served by `vkd provider-serve`, and the
//! Python example (examples/python-plugin, grpcio from PyPI, set up by
//! `e2e/cluster build-python-plugin`), and `vkd-slurm` on a real Slurm
//! cluster (Debian's slurm-wlm, `e2e/cluster build-slurm`). Each must pass
//! every check; a plugin that is not there is a failure naming its endpoint.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};

const VKD: &str = env!("CARGO_BIN_EXE_vkd");

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn scratch(name: &str) -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("vkd-plugins-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// A plugin process, killed on drop.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(mut cmd: Command, socket: &Path, log: &Path) -> Result<Running> {
    let log = std::fs::File::create(log)?;
    let child = cmd
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("starting the plugin")?;
    let running = Running(child);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !socket.exists() {
        ensure!(
            Instant::now() < deadline,
            "no socket at {}",
            socket.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(running)
}

fn conformance(socket: &Path) -> Result<Output> {
    Ok(Command::new(VKD)
        .args(["provider-conformance", "--endpoint"])
        .arg(format!("unix://{}", socket.display()))
        .output()?)
}

fn all_passed(out: &Output, what: &str) -> Result<()> {
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("{what}:\n{text}{}", String::from_utf8_lossy(&out.stderr));
    ensure!(
        out.status.success(),
        "{what} failed the conformance program"
    );
    ensure!(text.contains("6 of 6 checks passed"), "{what}: {text}");
    ensure!(!text.contains("FAIL"), "{what}: {text}");
    Ok(())
}

#[test]
fn the_sim_served_over_the_protocol_passes_the_conformance_program() -> Result<()> {
    let dir = scratch("sim")?;
    let socket = dir.join("provider.sock");
    let mut cmd = Command::new(VKD);
    cmd.args(["provider-serve", "--provider", "sim", "--provider-config"])
        .arg(repo().join("testdata/fleets/demo.yaml"))
        .arg("--state-dir")
        .arg(&dir)
        .arg("--listen")
        .arg(format!("unix://{}", socket.display()));
    let _plugin = start(cmd, &socket, &dir.join("plugin.log"))?;
    all_passed(&conformance(&socket)?, "the sim over the protocol")?;
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

#[test]
fn the_python_example_plugin_passes_the_conformance_program() -> Result<()> {
    let built = Command::new(repo().join("e2e/cluster"))
        .arg("build-python-plugin")
        .stderr(Stdio::inherit())
        .output()?;
    ensure!(
        built.status.success(),
        "e2e/cluster build-python-plugin failed"
    );
    let python = PathBuf::from(String::from_utf8(built.stdout)?.trim()).join("python");
    let dir = scratch("python")?;
    let socket = dir.join("provider.sock");
    let mut cmd = Command::new(python);
    cmd.arg(repo().join("examples/python-plugin/plugin.py"))
        .arg("--listen")
        .arg(format!("unix://{}", socket.display()));
    let _plugin = start(cmd, &socket, &dir.join("plugin.log"))?;
    all_passed(&conformance(&socket)?, "the Python example")?;
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

#[test]
fn the_slurm_plugin_on_a_real_slurm_cluster_passes_the_conformance_program() -> Result<()> {
    let dir = scratch("slurm")?;
    let state = dir.join("state");
    let bin = std::path::Path::new(VKD).with_file_name("vkd-slurm");
    ensure!(
        bin.exists(),
        "{} is not built (cargo test --workspace builds it)",
        bin.display()
    );
    let lua = Command::new(&bin)
        .arg("job-submit-lua")
        .arg(format!("--state-dir={}", state.display()))
        .output()?;
    ensure!(lua.status.success(), "vkd-slurm job-submit-lua: {lua:?}");
    let slurm = vkd_e2e::slurm::SlurmCluster::start(
        &dir.join("slurm"),
        &[4, 2, 2],
        Some(&String::from_utf8(lua.stdout)?),
    )?;
    let socket = dir.join("provider.sock");
    let mut cmd = Command::new(&bin);
    cmd.arg("serve")
        .arg(format!("--listen=unix://{}", socket.display()))
        .arg(format!("--state-dir={}", state.display()))
        .arg(format!("--slurm-conf={}", slurm.conf().display()))
        .arg("--poll=500ms")
        // The test cluster runs its jobs as the test's user, root here.
        .arg("--jobs-as-root");
    let plugin = start(cmd, &socket, &dir.join("plugin.log"))?;
    all_passed(&conformance(&socket)?, "the Slurm plugin")?;
    drop(plugin);
    drop(slurm);
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

#[test]
fn no_plugin_at_the_endpoint_is_a_failure_naming_it() -> Result<()> {
    let dir = scratch("none")?;
    let socket = dir.join("nobody.sock");
    let out = conformance(&socket)?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.code() == Some(1), "exit {:?}: {err}", out.status);
    ensure!(err.contains("nobody.sock"), "{err}");
    let bad = Command::new(VKD)
        .args(["provider-conformance", "--endpoint", "grpc://x"])
        .output()?;
    ensure!(
        bad.status.code() == Some(64),
        "a bad endpoint: {:?}",
        bad.status
    );
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}
