//! The shim and launcher as a binary of their own, for this crate's tests. In a
//! deployment the `vkd` binary plays both parts (`vkd process-shim`, `vkd process-launch`).

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().collect();
    match vkd_process::dispatch(&args) {
        Some(code) => std::process::ExitCode::from(u8::try_from(code).unwrap_or(1)),
        None => {
            eprintln!(
                "usage: vkd-process-shim process-shim DIR | process-launch [..] -- PROGRAM .."
            );
            std::process::ExitCode::from(64)
        }
    }
}
