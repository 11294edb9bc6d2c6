// The live cells (book/_ext/live_cells.py): a code cell tagged `live` becomes editable, with a Run button.
// Nothing is fetched until the first Run; then a worker (live-worker.mjs) starts the book's own Pyodide and
// runs the cell's code there, and what it prints (or its traceback) replaces the output under the cell.
(() => {
  const here = document.currentScript ? new URL(".", document.currentScript.src) : null; // the build's _static/
  const zh = (document.documentElement.lang || "").toLowerCase().startsWith("zh");
  const T = zh ? {
    label: "可运行单元格：在浏览器里修改并运行（纯 Python，仅用标准库）",
    run: "运行", stop: "停止", reset: "还原",
    starting: "正在启动 Python（首次运行需下载约 13 MB）……", running: "正在运行……",
    stopped: "已停止。再次点击“运行”会重新启动 Python。", ran: "已运行", failed: "运行出错",
    noWasm: "此浏览器不支持 WebAssembly，无法运行可运行的代码；下方是随书保存的输出。",
    noHttp: "通过 file:// 打开的页面无法启动 Python。请用 HTTP 提供本书，例如：" +
      "python -m http.server --directory _build/html，然后打开 http://localhost:8000/。",
    noStart: "Python 无法启动：",
  } : {
    label: "Live cell: edit the code and run it in your browser (pure Python, standard library only)",
    run: "Run", stop: "Stop", reset: "Reset",
    starting: "Starting Python (the first run downloads about 13 MB)…", running: "Running…",
    stopped: "Stopped. Run again to start Python afresh.", ran: "Ran", failed: "Raised an exception",
    noWasm: "This browser runs no WebAssembly, so the live cells cannot run here; the output below is the one " +
      "stored with the book.",
    noHttp: "A page opened from a file cannot start Python. Serve the book over HTTP, for example " +
      "python -m http.server --directory _build/html, and open http://localhost:8000/.",
    noStart: "Python could not be started: ",
  };

  let worker = null;
  let started = false; // the worker has answered once: Python is up
  const waiting = new Map(); // message id -> the cell's callback
  let nextId = 0;

  function whyNot() {
    if (typeof WebAssembly !== "object" || typeof Worker !== "function") return T.noWasm;
    if (location.protocol === "file:" || !here) return T.noHttp;
    return null;
  }

  function theWorker() {
    if (!worker) {
      worker = new Worker(new URL("live-worker.mjs", here), { type: "module" });
      worker.onmessage = (event) => {
        started = true;
        const done = waiting.get(event.data.id);
        waiting.delete(event.data.id);
        if (done) done(event.data);
      };
      worker.onerror = (event) => {
        event.preventDefault();
        stopWorker({ error: event.message || "the worker could not be loaded" });
      };
    }
    return worker;
  }

  function stopWorker(answer) {
    if (worker) worker.terminate();
    worker = null;
    started = false;
    for (const done of waiting.values()) done(answer);
    waiting.clear();
  }

  function setUp(cell) {
    const pre = cell.querySelector(".cell_input pre");
    if (!pre) return;
    const shownCode = pre.innerHTML;
    let outputBox = cell.querySelector(".cell_output");
    const shownOutput = outputBox ? outputBox.innerHTML : null;

    const bar = document.createElement("div");
    bar.className = "live-bar";
    const button = (text, cls) => {
      const b = document.createElement("button");
      b.type = "button";
      b.textContent = text;
      b.className = cls;
      bar.appendChild(b);
      return b;
    };
    const run = button(T.run, "live-run");
    const stop = button(T.stop, "live-stop");
    const reset = button(T.reset, "live-reset");
    stop.hidden = true;
    const status = document.createElement("span");
    status.className = "live-status";
    status.textContent = T.label;
    bar.appendChild(status);
    cell.insertBefore(bar, cell.firstChild);

    pre.contentEditable = "plaintext-only";
    if (pre.contentEditable !== "plaintext-only") pre.contentEditable = "true";
    pre.spellcheck = false;
    pre.setAttribute("role", "textbox");
    pre.setAttribute("aria-multiline", "true");
    pre.setAttribute("aria-label", T.label);
    // Shift+Enter runs, as in Jupyter; Tab is left to move the focus on (type spaces to indent)
    pre.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && event.shiftKey) { event.preventDefault(); run.click(); }
    });

    function message(text) {
      let box = cell.querySelector(".live-message");
      if (!box) {
        box = document.createElement("div");
        box.className = "live-message";
        bar.after(box);
      }
      box.textContent = text;
    }

    function show(text, failed) {
      if (!outputBox) {
        outputBox = document.createElement("div");
        outputBox.className = "cell_output docutils container";
        cell.appendChild(outputBox);
      }
      outputBox.innerHTML = '<div class="output stream highlight-myst-ansi notranslate"><div class="highlight"><pre></pre></div></div>';
      outputBox.querySelector("pre").textContent = text;
      outputBox.classList.toggle("live-failed", failed);
      outputBox.classList.add("live-output");
    }

    run.addEventListener("click", () => {
      const why = whyNot();
      if (why) { message(why); return; }
      const id = nextId++;
      run.disabled = true;
      stop.hidden = false;
      status.textContent = started ? T.running : T.starting;
      waiting.set(id, (answer) => {
        run.disabled = false;
        stop.hidden = true;
        if (answer.stopped) { status.textContent = T.stopped; return; }
        if (answer.error !== undefined) { status.textContent = T.failed; message(T.noStart + answer.error); return; }
        status.textContent = answer.failed ? T.failed : T.ran;
        show(answer.output, answer.failed);
      });
      try {
        theWorker().postMessage({ id, source: pre.innerText.replace(/\n$/, "") });
      } catch (err) {
        stopWorker({ error: String(err && err.message ? err.message : err) });
      }
    });
    stop.addEventListener("click", () => stopWorker({ stopped: true }));
    reset.addEventListener("click", () => {
      pre.innerHTML = shownCode;
      if (shownOutput === null) { if (outputBox) outputBox.remove(); outputBox = null; }
      else { outputBox.innerHTML = shownOutput; outputBox.classList.remove("live-failed", "live-output"); }
      const box = cell.querySelector(".live-message");
      if (box) box.remove();
      status.textContent = T.label;
    });
  }

  const setUpAll = () => document.querySelectorAll("div.cell.tag_live").forEach(setUp);
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", setUpAll);
  else setUpAll();
})();
