//! `kvroute serve` configured from the environment alone, as a container
//! deployment configures it: every flag has a `KVROUTE_*` variable.

use std::process::Stdio;

use crate::support::http::*;
use crate::support::*;

#[test]
fn serve_takes_its_port_workers_and_token_from_the_environment() {
    let (_mocker, lines) = start_mocker(2, "100");
    let mut child = kvroute()
        .arg("serve")
        .env("KVROUTE_PORT", "0")
        .env("KVROUTE_WORKERS", lines.join(";"))
        .env("KVROUTE_ADMIN_TOKEN", "from-env")
        .env("KVROUTE_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvroute serve runs");
    let stderr = child.stderr.take().expect("stderr");
    let _serve = Proc(child);
    // Port 0 from the environment: the router binds an ephemeral port and
    // says which (without the variable it would listen on its default, 8000).
    let serve = listening_addr(stderr);
    let port: u16 = serve
        .strip_prefix("127.0.0.1:")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("not 127.0.0.1:PORT: {serve}"));
    assert!(port != 0 && port != 8000, "KVROUTE_PORT=0 ignored: {serve}");
    let token = [("Authorization", "Bearer from-env")];
    eventually("both workers from KVROUTE_WORKERS connected", || {
        std::net::TcpStream::connect(&serve).is_ok() && {
            let doc = request_with(&serve, "GET", "/workers", &token, "").json();
            doc["workers"].as_array().is_some_and(|ws| {
                ws.len() == 2 && ws.iter().all(|w| w["ranks"][0]["connected"] == true)
            })
        }
    });
    // The admin token came from the environment too.
    assert_eq!(request(&serve, "GET", "/workers", "").status, 401);
}

#[test]
fn help_names_the_environment_variable_of_every_flag() {
    let out = kvroute()
        .args(["serve", "--help"])
        .output()
        .expect("kvroute serve --help");
    let help = String::from_utf8_lossy(&out.stdout);
    let flags = help
        .lines()
        .filter(|l| l.trim_start().starts_with("--"))
        .count();
    let envs = help.matches("[env: KVROUTE_").count();
    assert!(flags > 30, "{help}");
    // `-h, --help` is not counted among the flags and has no variable.
    assert_eq!(envs, flags, "{help}");
    assert!(help.contains("[env: KVROUTE_WORKERS=]"));
}
