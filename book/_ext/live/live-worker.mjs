// The live cells' Python (book/_ext/live_cells.py): Pyodide, the book's own copy under pyodide/ at the
// root of the build (never a CDN), started on the first Run, in a worker so that a run that does not end
// can be stopped. The page sends {id, source}; the worker says {ready: true} once Python has started, and
// answers each message with {id, output, traceback} (traceback "" when the code did not raise) or {id, error}.
import { loadPyodide } from "../pyodide/pyodide.mjs";

// normlib's modules that need no torch (listed in live/normlib/files.json by book/_ext/live_cells.py) and
// the runner, written into the interpreter's files: `from normlib import pure` works here as in the notebook,
// with a normlib package that holds only those modules.
const RUNNER = `
import io, linecache, sys, traceback

sys.path.insert(0, "/home/pyodide")

def normlib_live_run(source):
    """Run one cell's source as Python runs a script: what it prints, and the traceback if it raises."""
    out, tb = io.StringIO(), io.StringIO()
    saved = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = out
    linecache.cache["<cell>"] = (len(source), None, source.splitlines(True), "<cell>")
    try:
        code = compile(source, "<cell>", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except BaseException as err:  # SystemExit and KeyboardInterrupt too: shown, not raised
        frames = None if isinstance(err, SyntaxError) else err.__traceback__.tb_next  # not this function's frame
        traceback.print_exception(type(err), err, frames, file=tb)
    finally:
        sys.stdout, sys.stderr = saved
    return out.getvalue(), tb.getvalue()
`;

let started = null;

async function start() {
  const indexURL = new URL("../pyodide/", import.meta.url);
  // Pyodide only logs a warning and never settles when the interpreter's .wasm is missing (Pyodide 314.0.7):
  // ask the host first, so that a reader is told instead of waiting forever
  const wasm = await fetch(new URL("pyodide.asm.wasm", indexURL), { method: "HEAD" });
  if (wasm.status === 404 || wasm.status === 410) throw new Error(`pyodide/pyodide.asm.wasm: HTTP ${wasm.status}`);
  const py = await loadPyodide({ indexURL: indexURL.href });
  const fetchText = async (name) => {
    const response = await fetch(new URL(`live/normlib/${name}`, import.meta.url));
    if (!response.ok) throw new Error(`live/normlib/${name}: HTTP ${response.status}`);
    return response.text();
  };
  py.FS.mkdirTree("/home/pyodide/normlib");
  py.FS.writeFile("/home/pyodide/normlib/__init__.py",
    '"""normlib in the browser: only its modules that need no torch."""\n');
  for (const name of JSON.parse(await fetchText("files.json"))) {
    py.FS.writeFile(`/home/pyodide/normlib/${name}`, await fetchText(name));
  }
  py.runPython(RUNNER);
  return py;
}

self.onmessage = async (event) => {
  const { id, source } = event.data;
  try {
    if (!started) {
      started = start().catch((err) => { started = null; throw err; }); // a failed start is tried again
      started.then(() => self.postMessage({ ready: true }), () => {});
    }
    const py = await started;
    const result = py.globals.get("normlib_live_run")(source);
    const [output, traceback] = result.toJs();
    result.destroy();
    self.postMessage({ id, output, traceback });
  } catch (err) {
    self.postMessage({ id, error: String(err && err.message ? err.message : err) });
  }
};
