// A validation is running (seconds): show its result, unless someone is filling in the form.
(function () {
  setTimeout(function () {
    var name = document.getElementById("id_name"), files = document.getElementById("id_files");
    if (!(name && name.value) && !(files && files.value)) { window.location.reload(); }
  }, 3000);
})();
