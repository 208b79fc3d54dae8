//! `vkd run` with the process provider refuses to start as anyone but root:
//! Pods would run as vkd itself, able to read its token and state.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test file: a failed unwrap is a failed test

use std::process::Command;

#[test]
fn a_non_root_vkd_refuses_the_process_provider() {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let root = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .is_some_and(|ids| ids.split_whitespace().nth(1) == Some("0"));
    if !root {
        eprintln!("skipped: needs root to start vkd as another user");
        return;
    }
    let Ok(setpriv) = which("setpriv") else {
        eprintln!("skipped: setpriv (util-linux) is not installed");
        return;
    };
    let dir = std::env::temp_dir().join(format!("vkd-identity-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let out = Command::new(setpriv)
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(env!("CARGO_BIN_EXE_vkd"))
        .args(["run", "--node-name", "vk-identity", "--provider", "process"])
        .arg("--state-dir")
        .arg(&dir)
        .arg("--kubeconfig")
        .arg(dir.join("no-kubeconfig"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success(),
        "started as uid 65534:\n{stdout}\n{stderr}"
    );
    let said = format!("{stdout}{stderr}");
    assert!(
        said.contains("not root") && said.contains("every Pod would run as vkd itself"),
        "{said}"
    );
    assert!(
        !dir.join("process/pods").exists(),
        "it wrote state before refusing"
    );
    let _ = std::fs::remove_dir_all(dir);
}

fn which(program: &str) -> Result<std::path::PathBuf, ()> {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
        .ok_or(())
}
