from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("inference", "0009_deployment_task_by_operator"),
    ]

    operations = [
        migrations.AddField(
            model_name="modeldeployment",
            name="prefix_routing",
            field=models.BooleanField(
                default=True,
                help_text="Queue each request to the replica that holds its prompt's prefix in cache (by "
                "tenant and prompt, or prompt_cache_key), within a bounded load; idle replicas take what "
                "waits. Off: every replica reads one shared queue.",
            ),
        ),
    ]
